"""Scaling on this machine: the same training step at DP=1 vs DP=2, TP=1 vs TP=2, EP=1 vs EP=2 (torchrun, gloo).

One actor training step (forward + backward + optimizer) on a fixed batch (`--samples` x `--seq` tokens) of a
small Qwen3-MoE, median of `--steps` after a warm-up, for each layout in a fresh torchrun job. Reported as the
step time and throughput ratio to the single process: what a user sees from adding a rank here (2 CPU
cores: two ranks share them, so ratios near 1 are the ceiling, not a defect).

    PYTHONPATH=. python benchmarks/bench_scaling.py [--samples 32] [--seq 64] [--steps 5]
Results: a table on stdout and JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LAYOUTS = {"single": (1, []), "dp2": (2, []), "tp2": (2, ["--tp", "2"]), "ep2": (2, ["--ep", "2"])}


def run(nproc: int, extra: list[str], model: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "benchmarks" / "workers" / "scaling_step.py"), "--model", str(model), "--samples",
           str(args.samples), "--seq", str(args.seq), "--steps", str(args.steps), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])


def main() -> None:
    from megatron_rl.tiny_model import BENCH_SPEC, make_tiny_qwen3_moe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_qwen3_moe(Path(tmp) / "model", BENCH_SPEC, seed=2)
        results = {name: run(nproc, extra, model, args) for name, (nproc, extra) in LAYOUTS.items()}
    base = results["single"]["seconds"]
    print(f"{'layout':<8}{'ranks':>6}{'s/step':>9}{'tokens/s':>10}{'vs single':>11}")
    for name, r in results.items():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["speedup_vs_single"] = base / r["seconds"]
        print(
            f"{name:<8}{LAYOUTS[name][0]:>6}{r['seconds']:>9.3f}{r['tokens_per_s']:>10.0f}{r['speedup_vs_single']:>10.2f}x"
        )
    date = datetime.date.today().isoformat()
    out = {"date": date, "machine": f"{os.uname().machine} CPU, {os.cpu_count()} cores",
           "command": "PYTHONPATH=. python benchmarks/bench_scaling.py " + " ".join(sys.argv[1:]),
           "batch": {"samples": args.samples, "seq": args.seq}, "layouts": results}  # fmt: skip
    dest = ROOT / "benchmarks" / "results" / f"scaling_{date}.json"
    dest.write_text(json.dumps(out, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
