"""Run under torchrun: one model, several parallel layouts in turn (one process start for all of them).

Per layout (Megatron's groups rebuilt in the same processes): load the HF checkpoint, score the samples
(log-probs, entropy, recorded routes), export the weights back to HF and compare them bitwise with the checkpoint,
then train with routing replay, R2 (routes recorded by the old-policy pass) for 2 updates and R3 (the rollout
engine's routes, given as `--r3-routes`) for 1 update, on PPO with fixed advantages. Writes JSON (rank 0) keyed
by layout name for tests/models/family_checks.py to compare with transformers and across layouts.
"""

import argparse
import json
from pathlib import Path

import torch


def _batch(samples: list[dict], r3_routes: list | None, k: int):
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.routing.cache import padding_routes

    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), 3, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    starts = torch.tensor([s["response_start"] for s in samples])
    batch = TokenBatch(ids, lengths, starts)
    advantages = torch.linspace(-1.0, 1.0, len(samples))
    batch.fields["advantages"] = advantages.unsqueeze(1).expand(ids.shape).contiguous()
    routes = None
    if r3_routes is not None:  # SGLang's layout: no row for a sample's last token
        layers = len(r3_routes[0][0])
        routes = padding_routes(len(samples), longest, layers, k, torch.int16)
        for i, sample_routes in enumerate(r3_routes):
            routes[i, : len(sample_routes)] = torch.tensor(sample_routes, dtype=torch.int16)
    return batch, routes


def _train(actor, batch, routes, updates: int) -> list[dict]:
    """`updates` PPO updates replaying `routes`, old log-probs scored by the same weights with the same routes."""
    from megatron_rl.algorithms import policy_loss

    batch.routes = routes
    batch.fields["old_log_probs"] = actor.compute_log_probs(batch, route_mode="replay").log_probs

    def loss_fn(logp, ent, mb):
        mask = mb.response_mask().to(logp.device).float()
        old, adv = mb.fields["old_log_probs"].to(logp.device), mb.fields["advantages"].to(logp.device)
        loss, metrics = policy_loss("ppo", logp, old, adv, mask)
        count = mask.sum().to(torch.int)
        return loss * count, count, {"ppo_kl": metrics["ppo_kl"]}

    return [actor.train_step(batch, loss_fn, route_mode="replay") for _ in range(updates)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True, help="JSON list of {input_ids, response_start}")
    parser.add_argument("--layouts", required=True, help="JSON list of {name, **ParallelLayout fields}")
    parser.add_argument("--r3-routes", default=None, help="JSON: per sample [len - 1][moe_layers][top_k]")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.megatron_backend.weights.hf_weights import SafetensorsIndex
    from megatron_rl.parallel_layout import ParallelLayout

    samples = json.loads(Path(args.samples).read_text())
    r3 = json.loads(Path(args.r3_routes).read_text()) if args.r3_routes else None
    checkpoint = SafetensorsIndex(Path(args.model))
    results = {}
    for spec in json.loads(args.layouts):
        name = spec.pop("name")
        layout = ParallelLayout(**spec)
        init_distributed(layout, seed=7)
        actor = MegatronActor.from_hf(
            args.model,
            layout,
            model_options=ModelOptions(dispatcher="alltoall"),
            optimizer_options=OptimizerOptions(lr=1e-3, clip_grad=1.0),
            micro_batch_tokens=64,
        )
        exported = {n: t for bucket in actor.export_hf(bucket_bytes=1 << 16) for n, t in bucket}
        export_equal = sorted(exported) == sorted(checkpoint.names()) and all(
            torch.equal(t, checkpoint.get(n).to(t.dtype)) for n, t in exported.items()
        )
        batch, r3_routes = _batch(samples, r3, actor.dims.top_k)
        scored = actor.compute_log_probs(batch, with_entropy=True, route_mode="record")
        r2 = _train(actor, batch, scored.routes, 2)
        r3_steps = _train(actor, batch, r3_routes, 1) if r3_routes is not None else []
        results[name] = {
            "log_probs": scored.log_probs.tolist(),
            "entropy": scored.entropy.tolist(),
            "routes": scored.routes.long().tolist(),
            "export_equal": export_equal,
            "exported_names": len(exported),
            "r2": [{"loss": m["loss"], "ppo_kl": m["ppo_kl"], "grad_norm": m["grad_norm"]} for m in r2],
            "r3": [{"loss": m["loss"], "ppo_kl": m["ppo_kl"], "grad_norm": m["grad_norm"]} for m in r3_steps],
        }
        del actor
        layout.destroy()
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    main()
