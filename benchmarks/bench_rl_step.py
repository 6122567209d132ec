"""RL step breakdown on the embedded default, and the cost of routing replay.

Runs `megatron-rl train` on the tiny-MoE demo (warm-up skipped, a fixed number of steps, a checkpoint every
step) in a fresh output directory, reads its `metrics.jsonl` and reports per phase the mean seconds and share
of the step (rollout with rewards, old-policy log-probs, training, weight sync, checkpoint) and tokens per
second; step 1 is left out (one-time warm-up of kernels and caches).

With `trainer.offload_actor=true rollout.release_memory=true` it also reports the colocated memory phases
(actor offload/reload, engine release/resume: seconds per step, bytes moved).

`--replay` runs the same steps with routing replay off, R2 and R3 and reports the training pass, the
old-policy pass and the peak resident memory of the training process as ratios to `off` (budget: R2 adds
at most 3% to the training pass). Runs are interleaved (off, R2, R3, off, R2, R3, ...) `--repeats` times so
that the shared machine's drift hits all three alike; the medians are compared.

    python benchmarks/bench_rl_step.py [--steps 20] [key=value overrides ...]
    python benchmarks/bench_rl_step.py --replay [--steps 20] [--repeats 3]
Results: a table on stdout and JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/rollout", "time/old_logp", "time/train", "time/weight_sync", "time/checkpoint")
# Runs the CLI and prints the process's peak RSS last (ru_maxrss, KiB on Linux).
WRAPPER = (
    "import resource, runpy, sys\n"
    "sys.argv = ['megatron-rl', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('megatron_rl.cli', run_name='__main__')\n"
    "finally:\n    print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
)


def run_steps(steps: int, overrides: list[str]) -> tuple[dict[str, float], int]:
    """Mean metrics over steps 2.. and the peak RSS (bytes) of one training run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable, "-c", WRAPPER, "train", str(ROOT / "examples" / "tiny_moe_gspo.yaml"),
            f"trainer.output_dir={out}", f"model.hf_path={Path(tmp) / 'model'}", f"trainer.steps={steps}",
            "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0", "trainer.save_every=1", "trainer.keep_last=1",
            "logging.wandb=false", "logging.plot=false", *overrides,
        ]  # fmt: skip
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    peak = int(proc.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0]) * 1024
    rows = [r for r in history if r["step"] > 1]
    keys = {k for r in rows for k in r if k.startswith(("time/", "perf/", "memory/"))}
    return {k: statistics.fmean(r.get(k, 0.0) for r in rows) for k in keys}, peak


def machine() -> str:
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def breakdown(args: argparse.Namespace) -> dict:
    mean, peak = run_steps(args.steps, args.overrides)
    step = mean["time/step"] + mean.get("time/checkpoint", 0.0)
    rows = [(p.split("/")[1], mean.get(p, 0.0)) for p in PHASES]
    rows.append(("other (rewards, batching, logging)", step - sum(s for _, s in rows)))
    print(f"{'phase':<36}{'seconds':>10}{'share':>8}")
    for name, seconds in rows:
        print(f"{name:<36}{seconds:>10.4f}{seconds / step:>8.1%}")
    print(f"{'step':<36}{step:>10.4f}\ntokens/s: {mean['perf/tokens_per_s']:.0f}; peak RSS {peak / 2**30:.2f} GiB")
    # Colocated memory phases (trainer.offload_actor, rollout.release_memory), inside rollout / weight sync.
    swaps = {k: v for k, v in sorted(mean.items()) if k.startswith(("time/actor_", "time/engine_", "memory/"))}
    for key, value in swaps.items():
        print(f"  {key:<34}{value:>10.4f}" + (" GiB" if key.startswith("memory/") else " s"))
    return {
        "colocated_memory": swaps,
        "phases": {name: {"seconds": s, "share": s / step} for name, s in rows},
        "step_seconds": step,
        "tokens_per_s": mean["perf/tokens_per_s"],
        "peak_rss_bytes": peak,
    }


def replay_overhead(args: argparse.Namespace) -> dict:
    modes = ("off", "R2", "R3")
    runs: dict[str, list[tuple[dict, int]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(run_steps(args.steps, [f"algo.routing_replay={mode}", *args.overrides]))
    med = {
        m: {
            "train_s": statistics.median(r[0]["time/train"] for r in runs[m]),
            "old_logp_s": statistics.median(r[0]["time/old_logp"] for r in runs[m]),
            "step_s": statistics.median(r[0]["time/step"] for r in runs[m]),
            "peak_rss_bytes": statistics.median(r[1] for r in runs[m]),
        }
        for m in modes
    }
    print(f"{'replay':<8}{'train s':>10}{'x off':>8}{'old-logp s':>12}{'x off':>8}{'step s':>9}{'x off':>8}"
          f"{'peak RSS GiB':>14}{'x off':>8}")  # fmt: skip
    for m in modes:
        r, o = med[m], med["off"]
        print(f"{m:<8}{r['train_s']:>10.4f}{r['train_s'] / o['train_s']:>8.3f}{r['old_logp_s']:>12.4f}"
              f"{r['old_logp_s'] / o['old_logp_s']:>8.3f}{r['step_s']:>9.4f}{r['step_s'] / o['step_s']:>8.3f}"
              f"{r['peak_rss_bytes'] / 2**30:>14.2f}{r['peak_rss_bytes'] / o['peak_rss_bytes']:>8.3f}")  # fmt: skip
    r2 = med["R2"]["train_s"] / med["off"]["train_s"]
    print(f"budget: R2 adds at most 3% to the training pass -> {'met' if r2 <= 1.03 else 'MISSED'} ({r2 - 1:+.1%})")
    return {"medians": med, "r2_train_ratio": r2, "r3_train_ratio": med["R3"]["train_s"] / med["off"]["train_s"],
            "r2_budget_met": r2 <= 1.03, "repeats": args.repeats}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replay", action="store_true", help="compare routing replay off / R2 / R3")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions with --replay")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    result = replay_overhead(args) if args.replay else breakdown(args)
    date = datetime.date.today().isoformat()
    result = {"date": date, "machine": machine(), "command": "python benchmarks/bench_rl_step.py " + " ".join(
        sys.argv[1:]), "steps": args.steps, **result}  # fmt: skip
    kind = "replay_overhead" if args.replay else "rl_step"
    if any(o.startswith(("trainer.offload_actor=true", "rollout.release_memory=true")) for o in args.overrides):
        kind += "_colocated_memory"
    dest = ROOT / "benchmarks" / "results" / f"{kind}_{date}.json"
    dest.write_text(json.dumps(result, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
