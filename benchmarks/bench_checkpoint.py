"""Step time with a checkpoint after every step: synchronous saves vs background ones (`trainer.async_save`), against
the same run without checkpoints.

Runs `megatron-rl train` on the tiny-MoE demo (warm-up skipped) three ways: no checkpoint but the last one (`none`),
a checkpoint every step written synchronously (`sync`) and in the background (`async`), interleaved `--repeats`
times so that the shared machine's drift hits all alike. Per mode it reports the medians over runs of the mean per
step (steps 2 to the one before last; step 1 warms caches up, the last step always saves) of the step (`time/step`)
and the time the loop spent in the save (`time/checkpoint`: the whole write when synchronous; the snapshot, the
publish of the previous save and any wait for it in the background), the checkpoint's share of step plus save, and
the cost: step plus save over the `none` run's step, minus one (it also counts a writer thread slowing the step).
`--model bench` runs the larger benchmark model (`tiny_model.BENCH_SPEC`, ~6 M parameters) instead of the demo's, so
that fixed costs do not dominate.

    python benchmarks/bench_checkpoint.py [--steps 12] [--repeats 3] [--model demo|bench] [key=value overrides ...]
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
MODES = {
    "none": ["trainer.save_every=0"],
    "sync": ["trainer.save_every=1", "trainer.async_save=false"],
    "async": ["trainer.save_every=1", "trainer.async_save=true"],
}


def run_steps(steps: int, model: Path, overrides: list[str]) -> dict[str, float]:
    """Mean seconds per step (steps 2 to steps-1) of the step and of the checkpoint in one training run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "examples" / "tiny_moe_gspo.yaml"),
            f"trainer.output_dir={out}", f"model.hf_path={model}", f"trainer.steps={steps}",
            "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0", "trainer.keep_last=1",
            "logging.wandb=false", "logging.plot=false", *overrides,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if 1 < r["step"] < steps]
    step = statistics.fmean(r["time/step"] for r in rows)
    save = statistics.fmean(r.get("time/checkpoint", 0.0) for r in rows)
    return {"step_s": step, "checkpoint_s": save, "share": save / (step + save)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=("demo", "bench"), default="demo")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args()

    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"  # the demo's tiny model is built there on first use
        if args.model == "bench":
            from megatron_rl.tiny_model import BENCH_SPEC, make_tiny_qwen3_moe

            make_tiny_qwen3_moe(model, BENCH_SPEC, seed=2)
        for _ in range(args.repeats):
            for mode, flags in MODES.items():
                runs[mode].append(run_steps(args.steps, model, [*flags, *args.overrides]))
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    base = medians["none"]["step_s"]
    for m in medians.values():
        m["cost"] = (m["step_s"] + m["checkpoint_s"]) / base - 1
    print(f"{'mode':<6} {'step s':>8} {'checkpoint s':>13} {'share':>7} {'step+save s':>12} {'cost vs none':>13}")
    for mode, m in medians.items():
        print(
            f"{mode:<6} {m['step_s']:8.3f} {m['checkpoint_s']:13.4f} {m['share']:7.1%} "
            f"{m['step_s'] + m['checkpoint_s']:12.3f} {m['cost']:13.1%}"
        )
    load = os.getloadavg()
    print(f"load average after the runs: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (results / f"checkpoint-{stamp}.json").write_text(
        json.dumps(
            {"args": vars(args), "host": platform.node(), "load": load, "runs": runs, "medians": medians}, indent=1
        )
    )


if __name__ == "__main__":
    main()
