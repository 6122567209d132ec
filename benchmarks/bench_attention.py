"""The local spec's core attention: torch SDPA against Megatron's unfused `DotProductAttention` on the demo's shapes.

One process, two actors built from the same checkpoint (`model.options.local_attention` sdpa and unfused; the
other options at their defaults, so packing is on), fp32. The batch has the demo's shape: `--batch` sequences
(8 prompts x 8 samples) of the synthetic task, prompt + response of 8 to 22 tokens. Timed per pass, interleaved
(sdpa, unfused, unfused, sdpa, ... `--repeats` rounds of `--passes` passes each), medians and minima (the least
disturbed round, on a shared machine) reported:
  score  `compute_log_probs(batch, with_entropy=True)` (the old-policy / reference pass)
  train  `warmup_step(batch, ..., lr=0)`: forward, backward and an optimizer step at learning rate 0 (the weights
         stay the same, so every pass computes the same thing)
Then a cProfile of `--profile-passes` scoring passes of each: the share of the time spent in core attention (the
cumulative time of the core attention module's outermost `forward`: the packed wrapper when packing is on).

    python benchmarks/bench_attention.py [--repeats 5] [--passes 10] [--spec demo|bench] [--threads 1]
        [--packing on|off] [--response 16]
Results: a table on stdout and JSON (with the load averages) in
benchmarks/results/attention_<spec>_r<response>_packing-<on/off>_threads<n>_<date>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
MODES: tuple[Literal["sdpa", "unfused"], ...] = ("sdpa", "unfused")
# The core attention module's forward, outermost first (the packed wrapper calls the class it wraps).
CORE_FORWARDS = ("packed_attention.py", "sdpa_attention.py", "dot_product_attention.py")


def demo_batch(batch: int, seed: int, response: int = 16) -> Any:
    """`batch` sequences of the demo's lengths: a 4-6 token prompt and a 4-`response` token response."""
    from megatron_rl.megatron_backend.actor.batch import TokenBatch

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, 7, (batch,), generator=gen)
    lengths = prompt + torch.randint(4, response + 1, (batch,), generator=gen)
    ids = torch.randint(4, 100, (batch, int(lengths.max())), generator=gen)
    return TokenBatch(ids, lengths, prompt)


def loss_fn(logp: torch.Tensor, _entropy: Any, mb: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
    mask = mb.response_mask().to(logp.device)
    return -(logp * mask).sum(), mask.sum().to(torch.int), {}


def core_attention_share(profile: cProfile.Profile) -> tuple[float, float]:
    """(seconds in core attention, seconds in `compute_log_probs`) of a profile."""
    stats: Any = pstats.Stats(profile).stats  # type: ignore[attr-defined]  # (untyped in typeshed)
    total = sum(ct for (f, _, name), (_, _, _, ct, _) in stats.items() if name == "compute_log_probs")
    for file in CORE_FORWARDS:
        core = [ct for (f, _, name), (_, _, _, ct, _) in stats.items() if f.endswith(file) and name == "forward"]
        if core:
            return sum(core), total
    raise RuntimeError("no core attention forward in the profile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=10, help="passes timed per repeat and mode")
    parser.add_argument("--profile-passes", type=int, default=80)
    parser.add_argument("--spec", choices=("demo", "bench"), default="demo", help="the demo's or BENCH_SPEC's model")
    parser.add_argument("--packing", choices=("on", "off"), default="on")
    parser.add_argument("--response", type=int, default=16, help="longest response (the demo's max_new_tokens)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron_rl.config.options import ModelOptions, OptimizerOptions
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.tiny_model import BENCH_SPEC, TinyQwen3MoeSpec, make_tiny_qwen3_moe

    init_distributed(ParallelLayout(), seed=1)
    batch = demo_batch(args.batch, args.seed, args.response)
    with tempfile.TemporaryDirectory() as tmp:
        spec = BENCH_SPEC if args.spec == "bench" else TinyQwen3MoeSpec()
        model = make_tiny_qwen3_moe(Path(tmp) / "model", spec)
        actors = {
            mode: MegatronActor.from_hf(
                model,
                ParallelLayout(),
                micro_batch_tokens=4096,
                model_options=ModelOptions(local_attention=mode, packing=args.packing == "on"),
                optimizer_options=OptimizerOptions(lr=0.0, clip_grad=0.0),
            )  # fmt: skip
            for mode in MODES
        }
    passes = {
        "score": lambda a: a.compute_log_probs(batch, with_entropy=True),
        "train": lambda a: a.warmup_step(batch, loss_fn, lr=0.0),
    }
    scores = {mode: actors[mode].compute_log_probs(batch, with_entropy=True) for mode in MODES}  # and warm-up
    for mode in MODES:
        actors[mode].warmup_step(batch, loss_fn, lr=0.0)
    max_err = float((scores["sdpa"].log_probs - scores["unfused"].log_probs).abs().max())
    times: dict[str, dict[str, list[float]]] = {p: {m: [] for m in MODES} for p in passes}
    loads = [os.getloadavg()[0]]
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            for name, run in passes.items():
                start = time.perf_counter()
                for _ in range(args.passes):
                    run(actors[mode])
                times[name][mode].append((time.perf_counter() - start) / args.passes)
        loads.append(os.getloadavg()[0])
    med = {p: {m: statistics.median(t) for m, t in ts.items()} for p, ts in times.items()}
    best = {p: {m: min(t) for m, t in ts.items()} for p, ts in times.items()}  # the least disturbed repeat
    shares = {}
    for mode in MODES:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.profile_passes):
            passes["score"](actors[mode])
        profile.disable()
        core, total = core_attention_share(profile)
        shares[mode] = {"core_attention_s": core, "compute_log_probs_s": total, "share": core / total}
    shutdown()

    tokens = int(batch.lengths.sum())
    longest = int(batch.lengths.max())
    print(f"{args.spec} model, {args.batch} sequences, {tokens} tokens (longest {longest}), packing {args.packing}, "
          f"threads {args.threads}, load {min(loads):.2f}-{max(loads):.2f}; sdpa vs unfused max |log-prob diff| "
          f"{max_err:.1e}")  # fmt: skip
    print(f"{'pass':<7}{'':<8}{'sdpa ms':>9}{'unfused ms':>12}{'unfused/sdpa':>14}")
    for p in passes:
        for stat, values in (("median", med[p]), ("min", best[p])):
            sdpa, unfused = values["sdpa"], values["unfused"]
            print(f"{p:<7}{stat:<8}{sdpa * 1e3:>9.2f}{unfused * 1e3:>12.2f}{unfused / sdpa:>13.2f}x")
    for mode, s in shares.items():
        print(f"cProfile, {args.profile_passes} scoring passes, {mode}: core attention {s['core_attention_s']:.3f} s "
              f"of {s['compute_log_probs_s']:.3f} s ({s['share']:.0%})")  # fmt: skip
    stamp = datetime.date.today().strftime("%Y%m%d")
    name = f"attention_{args.spec}_r{args.response}_packing-{args.packing}_threads{args.threads}_{stamp}.json"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps({"args": vars(args), "tokens": tokens, "loads": loads, "max_logprob_diff": max_err,
                               "medians_s": med, "min_s": best,
                               "speedup": {p: med[p]["unfused"] / med[p]["sdpa"] for p in med},
                               "profile": shares, "times_s": times}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
