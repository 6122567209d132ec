"""Packed vs padded micro-batches on a long-tailed length distribution: scoring and training throughput, peak memory.

One batch of `--batch` sequences with log-normal lengths clipped to [32, 2048] tokens, one actor (the benchmark
Qwen3-MoE of `megatron_rl.tiny_model.BENCH_SPEC`, fp32, one process): a scoring pass (`compute_log_probs`) and a
training pass (`warmup_step` at learning rate 0, so every repetition trains the same weights) with
`model.options.packing` on and off, the same token budget per micro-batch. Each mode runs in its own process (for
its peak memory), interleaved `--repeats` times; medians are reported. The padded layout's padding share p sets the
ideal speed-up 1 / (1 - p) (every padded token costs as much as a real one; attention, quadratic in the padded
length, can make the real gain larger).

    python benchmarks/bench_packing.py [--batch 32] [--budget 4096] [--repeats 3]
Results: a table on stdout and JSON in benchmarks/results/packing_<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = ("packed", "padded")


def lengths_of(batch: int, seed: int) -> list[int]:
    """Log-normal lengths (median ~256 tokens, long tail) clipped to [32, 2048]."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(batch, generator=gen) * 0.9 + 5.55)
    return [int(n) for n in raw.clamp(32, 2048).round()]


def padding_share(lengths: list[int], budget: int) -> float:
    from megatron_rl.megatron_backend.actor.batch import split_by_token_budget

    groups = split_by_token_budget(lengths, budget)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1 - sum(lengths) / padded


def vm_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> None:
    """One mode in this process: time a scoring and a training pass (after one warm-up of each)."""
    from megatron_rl.config.options import ModelOptions, OptimizerOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout, seed=1)
    actor = MegatronActor.from_hf(
        args.model, layout, model_options=ModelOptions(packing=args.mode == "packed"),
        optimizer_options=OptimizerOptions(lr=0.0, clip_grad=0.0), micro_batch_tokens=args.budget,
    )  # fmt: skip
    lengths = torch.tensor(lengths_of(args.batch, args.seed))
    ids = torch.randint(4, 120, (args.batch, int(lengths.max())), generator=torch.Generator().manual_seed(0))
    batch = TokenBatch(ids, lengths, torch.clamp(lengths // 2, min=1))

    def loss_fn(logp, _entropy, mb):
        mask = mb.response_mask().to(logp.device)
        return -(logp * mask).sum(), mask.sum().to(torch.int), {}

    actor.compute_log_probs(batch)
    actor.warmup_step(batch, loss_fn, lr=0.0)
    base = vm_rss_mib()
    t = time.perf_counter()
    actor.compute_log_probs(batch)
    score_s = time.perf_counter() - t
    t = time.perf_counter()
    actor.warmup_step(batch, loss_fn, lr=0.0)
    train_s = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shutdown()
    print(json.dumps({"score_s": score_s, "train_s": train_s, "peak_over_start_mib": peak - base}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return child(args)

    from megatron_rl.tiny_model import BENCH_SPEC, make_tiny_qwen3_moe

    lengths = lengths_of(args.batch, args.seed)
    share = padding_share(lengths, args.budget)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_qwen3_moe(Path(tmp) / "model", dataclasses.replace(BENCH_SPEC, max_position_embeddings=2048))
        for _ in range(args.repeats):
            for mode in MODES:
                cmd = [sys.executable, __file__, "--mode", mode, "--model", str(model), "--batch", str(args.batch),
                       "--budget", str(args.budget), "--seed", str(args.seed)]  # fmt: skip
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    tokens = sum(lengths)
    ratio = {
        "score_tokens_per_s": med["padded"]["score_s"] / med["packed"]["score_s"],
        "train_tokens_per_s": med["padded"]["train_s"] / med["packed"]["train_s"],
        "peak_memory": med["packed"]["peak_over_start_mib"] / med["padded"]["peak_over_start_mib"],
    }
    load = os.getloadavg()[0]
    print(f"{args.batch} sequences, {tokens} tokens (lengths {min(lengths)}-{max(lengths)}, median "
          f"{statistics.median(lengths):.0f}), budget {args.budget}; padded layout: {share:.1%} padding, ideal "
          f"speed-up {1 / (1 - share):.2f}x; threads {torch.get_num_threads()}, load {load:.1f}")  # fmt: skip
    print(f"{'mode':<8}{'score s':>9}{'train s':>9}{'peak MiB':>10}")
    for m in MODES:
        print(f"{m:<8}{med[m]['score_s']:>9.3f}{med[m]['train_s']:>9.3f}{med[m]['peak_over_start_mib']:>10.0f}")
    print(f"packed/padded: scoring tokens/s {ratio['score_tokens_per_s']:.2f}x, training tokens/s "
          f"{ratio['train_tokens_per_s']:.2f}x, peak memory {ratio['peak_memory']:.2f}x")  # fmt: skip
    stamp = datetime.date.today().strftime("%Y%m%d")
    out = ROOT / "benchmarks" / "results" / f"packing_{stamp}.json"
    out.write_text(json.dumps({"args": vars(args), "lengths": lengths, "padding_share": share,
                               "ideal_speedup": 1 / (1 - share), "load": load, "medians": med, "ratio": ratio,
                               "runs": runs}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
