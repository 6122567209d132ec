"""Data-parallel token imbalance before and after balancing (megatron_backend.balance), on long-tailed lengths.

Workload: mini-batches of ``--samples`` responses with log-normal lengths (median e^5.5 ~ 245 tokens, sigma 1,
clipped to [32, 2048]), ``--batches`` of them. Before: the trainer's row rule (rank r takes samples r, r + dp,
...). After: ``balanced_partition`` (equal sample counts per rank), with each method. Imbalance is max / mean
tokens per rank: a step waits for the slowest rank, so 1 / imbalance is the share of the data-parallel group's
token throughput that is used (for the token-linear part of the work; with ``--alpha`` > 0 the cost also counts
the quadratic attention term). Also: micro-batches per rank under ``--budget`` tokens (``split_micro_batches``)
and the time the partition takes.
Pure Python, no GPU. Run from the repository root: ``python benchmarks/bench_balance.py [--dp 2 4 8]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from megatron_rl.megatron_backend.actor.balance import (
    balanced_partition,
    imbalance,
    round_robin_partition,
    split_micro_batches,
)

RESULTS = Path(__file__).resolve().parent / "results"


def lognormal_lengths(n: int, rng: random.Random, low: int = 32, high: int = 2048) -> list[int]:
    return [min(high, max(low, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(n)]


def measure(dp: int, samples: int, batches: int, budget: int, seed: int) -> dict:
    rng = random.Random(seed)
    rows: dict[str, list[float]] = {"round_robin": [], "kk": [], "greedy": [], "best": []}
    micro: dict[str, list[int]] = {"round_robin": [], "best": []}
    seconds = []
    for _ in range(batches):
        lengths = lognormal_lengths(samples, rng)
        before = round_robin_partition(samples, dp)
        rows["round_robin"].append(imbalance(lengths, before))
        for method in ("kk", "greedy", "best"):
            start = time.perf_counter()
            after = balanced_partition(lengths, dp, method=method)
            if method == "best":
                seconds.append(time.perf_counter() - start)
            rows[method].append(imbalance(lengths, after))
        for name, parts in (("round_robin", before), ("best", after)):
            micro[name].append(max(len(split_micro_batches([lengths[i] for i in p], budget)) for p in parts))
    return {
        "dp": dp,
        "imbalance_mean": {k: round(statistics.mean(v), 4) for k, v in rows.items()},
        "imbalance_max": {k: round(max(v), 4) for k, v in rows.items()},
        "max_micro_batches_per_rank_mean": {k: round(statistics.mean(v), 2) for k, v in micro.items()},
        "partition_ms_median": round(1e3 * statistics.median(seconds), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--samples", type=int, default=128, help="samples per mini-batch")
    parser.add_argument("--batches", type=int, default=200, help="mini-batches measured")
    parser.add_argument("--budget", type=int, default=4096, help="micro-batch token budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = [measure(dp, args.samples, args.batches, args.budget, args.seed) for dp in args.dp]
    print(f"{args.batches} mini-batches of {args.samples} log-normal lengths in [32, 2048]; max/mean tokens per rank")
    print(f"{'dp':>3} {'round-robin':>18} {'KK':>18} {'greedy':>18} {'best':>18}   (mean / max)")
    for r in results:
        cells = [f"{r['imbalance_mean'][k]:.4f} / {r['imbalance_max'][k]:.4f}" for k in r["imbalance_mean"]]
        print(f"{r['dp']:>3} " + " ".join(f"{c:>18}" for c in cells))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench_balance_{datetime.date.today():%Y%m%d}.json"
    record = {
        "command": "python " + " ".join(sys.argv),
        "workload": vars(args) | {"lengths": "int(lognormvariate(5.5, 1.0)) clipped to [32, 2048]"},
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "results": results,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")


if __name__ == "__main__":
    main()
