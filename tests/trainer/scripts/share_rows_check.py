"""Run under torchrun: rank 0 holds a synthetic step batch (samples with R3 routes); `share_rows` sends each
data-parallel rank its rows (and its context- and tensor-parallel peers the same). Each rank writes what it
received, against what it should hold, to `--out/rank<r>.json`.

The samples are a pure function of (`--seed`, row), so every rank can rebuild the rows it expects.
"""

import argparse
import json
import pickle
from pathlib import Path

import numpy as np


def synthetic_sample(seed: int, row: int, tokens: int, layers: int, top_k: int, experts: int):
    from megatron_rl.rollout.sample import Sample

    rng = np.random.default_rng(seed * 100_003 + row)
    length = int(rng.integers(tokens // 2, tokens + 1))
    prompt = int(rng.integers(1, max(length // 4, 1) + 1))
    ids = rng.integers(0, 1000, size=length).tolist()
    routes = np.stack([rng.permutation(experts)[:top_k] for _ in range((length - 1) * layers)])
    return Sample(
        prompt_ids=ids[:prompt],
        response_ids=ids[prompt:],
        response_log_probs=rng.normal(-1.0, 0.5, size=length - prompt).tolist(),
        finish_reason="stop",
        weight_version="step-0",
        group_index=row // 8,
        routed_experts=routes.reshape(length - 1, layers, top_k).astype(np.uint8),
        reward=float(row % 2),
        metadata={"prompt_text": "x" * 200, "answer": "y" * 50},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    import torch.distributed as dist

    from megatron_rl.megatron_backend.distributed import data_parallel_rank_and_size, init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.trainer.step.step_plan import plan_step, share_rows

    init_distributed(ParallelLayout(tp=args.tp, cp=args.cp), seed=0)
    dp_rank, dp = data_parallel_rank_and_size()

    def make(row: int):
        return synthetic_sample(args.seed, row, args.tokens, args.layers, args.top_k, args.experts)

    lengths = [len(make(i).tokens) for i in range(args.samples)]
    plan = plan_step(lengths, mini_batches=2, epochs=1, dp=dp, seed=1234, step=1)
    everything = [make(i) for i in range(args.samples)] if dist.get_rank() == 0 else None
    received, nbytes = share_rows(everything, plan)
    rows = plan.rows_of(dp_rank)
    expected = [make(i) for i in rows]
    same = len(received) == len(expected) and all(
        a.tokens == b.tokens
        and a.response_log_probs == b.response_log_probs
        and np.array_equal(a.routed_experts, b.routed_experts)
        and a.routed_experts.dtype == np.uint8
        and a.metadata == {}
        for a, b in zip(received, expected, strict=False)
    )
    whole = len(pickle.dumps([make(i) for i in range(args.samples)], pickle.HIGHEST_PROTOCOL))
    from megatron.core import parallel_state as ps

    record = {
        "rank": dist.get_rank(), "dp_rank": dp_rank, "cp_rank": ps.get_context_parallel_rank(),
        "rows": rows, "same": same, "bytes": nbytes, "whole": whole,
    }  # fmt: skip
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    shutdown()


if __name__ == "__main__":
    main()
