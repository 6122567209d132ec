"""RL step breakdown on the embedded default: where each step's time goes.

Runs `megatron-rl train` on the tiny-MoE demo (warm-up skipped, a fixed number of steps) in a fresh output
directory, then reads its `metrics.jsonl` and reports, per phase, the mean seconds and share of the step, plus
tokens per second. Writes a table to stdout and JSON to benchmarks/results/rl_step_<date>.json.

    python benchmarks/bench_rl_step.py [--steps 20] [key=value overrides ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/rollout", "time/old_logp", "time/train", "time/weight_sync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "examples" / "tiny_moe_gspo.yaml"),
            f"trainer.output_dir={out}", f"model.hf_path={Path(tmp) / 'model'}", f"trainer.steps={args.steps}",
            "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0", "trainer.save_every=0",
            "logging.wandb=false", "logging.plot=false", *args.overrides,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in history if r["step"] > 1]  # step 1 includes one-time warm-up of kernels and caches
    mean = {k: sum(r[k] for r in steps) / len(steps) for k in (*PHASES, "time/step", "perf/tokens_per_s")}
    rows = [(p.split("/")[1], mean[p], mean[p] / mean["time/step"]) for p in PHASES]
    rows.append(("other (rewards, batching, logging)", mean["time/step"] - sum(mean[p] for p in PHASES), 0.0))
    rows[-1] = (rows[-1][0], rows[-1][1], rows[-1][1] / mean["time/step"])
    print(f"{'phase':<36}{'seconds':>10}{'share':>8}")
    for name, seconds, share in rows:
        print(f"{name:<36}{seconds:>10.4f}{share:>8.1%}")
    print(f"{'step':<36}{mean['time/step']:>10.4f}\ntokens/s: {mean['perf/tokens_per_s']:.0f}")
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} CPU, {__import__('os').cpu_count()} cores",
        "command": " ".join(["python", "benchmarks/bench_rl_step.py", f"--steps {args.steps}", *args.overrides]),
        "steps_averaged": len(steps),
        "phases": {name: {"seconds": s, "share": sh} for name, s, sh in rows},
        "step_seconds": mean["time/step"],
        "tokens_per_s": mean["perf/tokens_per_s"],
    }
    dest = ROOT / "benchmarks" / "results" / f"rl_step_{result['date']}.json"
    dest.write_text(json.dumps(result, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
