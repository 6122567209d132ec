"""Run under torchrun (1 process): score the same rollout samples with and without replaying their routes.

Input: a pickle of `Sample`s (with the engine's routed experts and log-probs). Output JSON: trainer-vs-rollout
log-prob mismatch (mean |Δ|, max |Δ|, k3 KL) with natural routing and with R3 replay, and the agreement of
the engine's routes with the trainer's natural routes.
"""

import json
import pickle
import sys

import torch


def main() -> None:
    model, samples_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
    from megatron_rl.algorithms import kl_penalty
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.routing.agreement import route_agreement
    from megatron_rl.trainer.step.rl_batch import samples_to_batch

    samples = pickle.load(open(samples_file, "rb"))
    init_distributed(ParallelLayout(), seed=0)
    actor = MegatronActor.from_hf(model, ParallelLayout())
    batch = samples_to_batch(samples, advantages=torch.zeros(len(samples)), with_routes=True)
    natural = actor.compute_log_probs(batch, route_mode="record")
    replayed = actor.compute_log_probs(batch, route_mode="replay")
    mask = batch.response_mask()
    rollout = batch.fields["rollout_log_probs"][mask]
    result = {}
    for name, scored in (("off", natural), ("R3", replayed)):
        trainer = scored.log_probs[mask]
        diff = (trainer - rollout).abs()
        result[name] = {
            "logp_abs_diff": float(diff.mean()),
            "logp_abs_diff_max": float(diff.max()),
            "k3_kl": float(kl_penalty(rollout, trainer, "k3").mean()),
        }
    valid = torch.zeros_like(mask)
    for i, s in enumerate(samples):
        valid[i, : len(s.tokens) - 1] = True
    agreement = route_agreement(natural.routes[valid].long(), batch.routes[valid].long())
    result["engine_vs_trainer_route_agreement"] = {
        "agreement": agreement.agreement,
        "token_all_layers_agree": agreement.token_all_layers_agree,
        "per_layer": agreement.per_layer,
    }
    result["tokens"] = int(mask.sum())
    json.dump(result, open(out, "w"), default=float)
    shutdown()


if __name__ == "__main__":
    main()
