"""Run under torchrun (2 ranks, DP=2): one RL step's scoring and two GRPO updates with R3 routes, fed two ways from
the same weights: every rank holding the whole batch (the actor takes its share of each mini-batch), and each
rank sent only its rows (`share_rows`, `RankRows`: the loop's path). Each rank writes both results to
`--out/rank<r>.json`; the test asserts they are bitwise equal.
"""

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch


def samples(count: int, vocab: int, layers: int, top_k: int, experts: int, seed: int = 3) -> list:
    from megatron_rl.rollout.sample import Sample

    rng = np.random.default_rng(seed)
    out = []
    for row in range(count):
        prompt, response = int(rng.integers(3, 9)), int(rng.integers(2, 12))
        ids = rng.integers(0, vocab, size=prompt + response).tolist()
        routes = np.stack([rng.permutation(experts)[:top_k] for _ in range((prompt + response - 1) * layers)])
        out.append(
            Sample(ids[:prompt], ids[prompt:], rng.normal(-1.0, 0.3, size=response).tolist(), "stop", "step-0",
                   group_index=row // 4, reward=float(rng.integers(0, 2)),
                   routed_experts=routes.reshape(prompt + response - 1, layers, top_k).astype(np.uint8))
        )  # fmt: skip
    return out


def weights_digest(actor) -> str:
    digest = hashlib.sha256()
    for module in actor.modules:
        for name, tensor in sorted(module.state_dict().items()):
            if torch.is_tensor(tensor):
                digest.update(name.encode())
                digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch.distributed as dist

    from megatron_rl.algorithms import compute_advantages
    from megatron_rl.config import load_config
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import data_parallel_rank_and_size, init_distributed, shutdown
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.trainer.step.rl_batch import samples_to_batch, select
    from megatron_rl.trainer.step.rl_loss import build_rl_loss
    from megatron_rl.trainer.step.step_plan import RankRows, plan_step, share_rows

    layout = ParallelLayout()
    dims = model_dims(read_hf_config(args.model))
    init_distributed(layout, seed=0, dims=dims)
    dp_rank, dp = data_parallel_rank_and_size()
    cfg = load_config(None, [f"model.hf_path={args.model}", "algo.preset=grpo", "algo.kl_coef=0"])
    loss_fn = build_rl_loss(cfg.algo)
    batch_samples = samples(16, dims.vocab_size, len(dims.moe_layers), dims.top_k, dims.num_experts)
    advantages = compute_advantages("grpo", torch.tensor([s.reward for s in batch_samples]), 4)
    plan = plan_step([len(s.tokens) for s in batch_samples], mini_batches=2, epochs=1, dp=dp, seed=1, step=1)

    def actor() -> MegatronActor:
        torch.manual_seed(0)
        return MegatronActor.from_hf(args.model, layout, optimizer_options=cfg.optimizer, micro_batch_tokens=256)

    def updates(a: MegatronActor, mini_batches) -> list[dict[str, float]]:
        return [a.train_step(mb, loss_fn, route_mode="replay") for mb in mini_batches]

    # Every rank holds the whole batch.
    whole_actor = actor()
    whole = samples_to_batch(batch_samples, advantages=advantages, with_routes=True)
    whole.fields["old_log_probs"] = torch.zeros_like(whole.fields["loss_mask"])
    for part in plan.mini_batches:
        whole.fields["old_log_probs"][part] = whole_actor.compute_log_probs(
            select(whole, part), route_mode="replay"
        ).log_probs
    whole_updates = updates(whole_actor, [select(whole, plan.mini_batches[m]) for m in plan.updates()])
    # This rank's rows only.
    sharded_actor = actor()
    mine, received = share_rows(batch_samples if dist.get_rank() == 0 else None, plan)
    rows = RankRows(plan, dp_rank)
    shard = samples_to_batch(mine, advantages=advantages[rows.rows], with_routes=True)
    shard.fields["old_log_probs"] = torch.zeros_like(shard.fields["loss_mask"])
    for m in range(len(plan.mini_batches)):
        scored = sharded_actor.compute_log_probs(rows.mini_batch(shard, m), route_mode="replay")
        shard.fields["old_log_probs"][rows.local(m)] = scored.log_probs
    shard_updates = updates(sharded_actor, [rows.mini_batch(shard, m) for m in plan.updates()])

    width = shard.input_ids.shape[1]
    record = {
        "rows": rows.rows,
        "received": received,
        "old_logp_equal": torch.equal(whole.fields["old_log_probs"][rows.rows, :width], shard.fields["old_log_probs"]),
        "whole_updates": whole_updates,
        "shard_updates": shard_updates,
        "whole_weights": weights_digest(whole_actor),
        "shard_weights": weights_digest(sharded_actor),
    }
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    shutdown()


if __name__ == "__main__":
    main()
