"""Bytes each rank receives and its peak host memory for one RL step's data: the whole batch to every rank
(before) against each data-parallel rank's rows only (now), at DP = 1, 2, 4 under torchrun (gloo, CPU).

    python benchmarks/bench_data_path.py                       # 16 samples of 16-32K tokens, with and without R3
    python benchmarks/bench_data_path.py --samples 8 --dp 1 2  # smaller

The batch is synthetic: `--samples` samples of `--tokens`/2 to `--tokens` tokens, each with the rollout's per-token
log-probs and, with R3, routes of DeepSeek-V3's shape (58 MoE layers x top-8 of 256 experts, uint8: 464 bytes a
token). `before` is what the loop did until the sharded path: rank 0 broadcast every sample to every rank, and the
scoring pass all-gathered every row's log-probs and entropy to every data-parallel rank. `now` is
`step_plan.share_rows` (each rank gets its rows of `step_plan.plan_step`) and nothing gathered. Per rank:
pickled bytes received, and peak RSS above the rank's RSS before the step's data arrived. Merged into
`benchmarks/results/data_path.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "data_path.json"
DSV3_LAYERS, DSV3_TOP_K = 58, 8


def _samples(count: int, tokens: int, routes: bool, seed: int = 0) -> list:
    from megatron_rl.rollout.sample import Sample

    rng = np.random.default_rng(seed)
    out = []
    for row in range(count):
        length = int(rng.integers(tokens // 2, tokens + 1))
        ids = rng.integers(0, 150_000, size=length).tolist()
        prompt = 512
        experts = rng.integers(0, 256, size=(length - 1, DSV3_LAYERS, DSV3_TOP_K), dtype=np.uint8) if routes else None
        out.append(
            Sample(ids[:prompt], ids[prompt:], rng.normal(-1, 0.5, size=length - prompt).tolist(), "stop", "step-0",
                   group_index=row // 8, routed_experts=experts, reward=float(row % 2), metadata={"prompt": "x" * 500})
        )  # fmt: skip
    return out


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: receive the step's data the `--variant` way; write this rank's figures."""
    import torch
    import torch.distributed as dist

    from megatron_rl.megatron_backend.distributed import (
        broadcast_object,
        data_parallel_rank_and_size,
        init_distributed,
        shutdown,
    )
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.trainer.step.rl_batch import samples_to_batch
    from megatron_rl.trainer.step.step_plan import RankRows, plan_step, share_rows

    init_distributed(ParallelLayout(), seed=0)
    rank = dist.get_rank()
    dp_rank, dp = data_parallel_rank_and_size()
    samples = _samples(args.samples, args.tokens, args.routes) if rank == 0 else None
    dist.barrier()
    start_rss, t0 = _rss_mib(), time.perf_counter()
    received = 0
    lengths = broadcast_object([len(s.tokens) for s in samples] if samples is not None else None)
    plan = plan_step(lengths, mini_batches=1, epochs=1, dp=dp, seed=0, step=1)
    rows = RankRows(plan, dp_rank)
    advantages = torch.zeros(len(lengths))
    if args.variant == "before":
        everything = broadcast_object(samples)
        if rank != 0:
            received += len(pickle.dumps(everything, pickle.HIGHEST_PROTOCOL))
        batch = samples_to_batch(everything, advantages=advantages)
        mine = plan.shares[0][dp_rank]
        scored = {"log_probs": batch.fields["rollout_log_probs"][mine], "entropy": batch.fields["loss_mask"][mine]}
        parts: list = [None] * dp
        if dp > 1:
            dist.all_gather_object(parts, (mine, scored))
            received += sum(len(pickle.dumps(p, pickle.HIGHEST_PROTOCOL)) for i, p in enumerate(parts) if i != dp_rank)
    else:
        mine_samples, received = share_rows(samples, plan)
        batch = samples_to_batch(mine_samples, advantages=advantages[rows.rows])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    record = {"rank": rank, "rows": batch.size, "bytes": received, "peak_mib": peak - start_rss, "seconds": seconds}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    shutdown()


def run(dp: int, variant: str, routes: bool, samples: int, tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(dp), "--master_port",
               str(29500 + (os.getpid() % 1000)), __file__, "--worker", "--out", out, "--variant", variant,
               "--samples", str(samples), "--tokens", str(tokens)] + (["--routes"] if routes else [])  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, cwd=REPO)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(dp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["before", "now"], help=argparse.SUPPRESS)
    parser.add_argument("--routes", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    table = []
    print("| DP | R3 routes | variant | rows per rank | MiB received (max rank) | peak MiB, other ranks (max) | "
          "peak MiB, rank 0 |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for routes in (False, True):
        for dp in args.dp:
            for variant in ("before", "now"):
                ranks = run(dp, variant, routes, args.samples, args.tokens)
                row = {"dp": dp, "routes": routes, "variant": variant, "ranks": ranks,
                       "rows_max": max(r["rows"] for r in ranks),
                       "mib_received_max": max(r["bytes"] for r in ranks) / 2**20,
                       "peak_mib_others": max((r["peak_mib"] for r in ranks[1:]), default=float("nan")),
                       "peak_mib_rank0": ranks[0]["peak_mib"]}  # fmt: skip
                table.append(row)
                print(f"| {dp} | {'yes' if routes else 'no'} | {variant} | {row['rows_max']} | "
                      f"{row['mib_received_max']:.1f} | {row['peak_mib_others']:.0f} | {row['peak_mib_rank0']:.0f} |",
                      flush=True)  # fmt: skip
    load = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    summary = {"command": " ".join(sys.argv), "commit": commit.strip(), "load": load, "samples": args.samples,
               "tokens": args.tokens, "rows": table}  # fmt: skip
    RESULTS.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
