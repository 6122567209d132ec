"""Step time with a checkpoint after every step: synchronous saves vs background ones (`trainer.async_save`).

Runs `megatron-rl train` on the tiny-MoE demo (warm-up skipped, a checkpoint every step) with
`trainer.async_save=false` and `=true`, interleaved `--repeats` times so that the shared machine's drift hits both
alike, and reports per mode the medians over runs of the mean per step (steps 2..; step 1 warms caches up) of
the step (`time/step`), the time the loop spent in the save (`time/checkpoint`: the whole write when synchronous;
waiting for the previous save plus the snapshot when in the background), and the checkpoint's share of the
step plus save.

    python benchmarks/bench_checkpoint.py [--steps 12] [--repeats 3] [key=value overrides ...]
Results: a table on stdout and JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": "trainer.async_save=false", "async": "trainer.async_save=true"}


def run_steps(steps: int, overrides: list[str]) -> dict[str, float]:
    """Mean seconds per step (steps 2..) of the step and of the checkpoint in one training run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "examples" / "tiny_moe_gspo.yaml"),
            f"trainer.output_dir={out}", f"model.hf_path={Path(tmp) / 'model'}", f"trainer.steps={steps}",
            "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0", "trainer.save_every=1", "trainer.keep_last=1",
            "logging.wandb=false", "logging.plot=false", *overrides,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 1]
    step = statistics.fmean(r["time/step"] for r in rows)
    save = statistics.fmean(r["time/checkpoint"] for r in rows)
    return {"step_s": step, "checkpoint_s": save, "share": save / (step + save)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args()

    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, flag in MODES.items():
            runs[mode].append(run_steps(args.steps, [flag, *args.overrides]))
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"{'mode':<6} {'step s':>8} {'checkpoint s':>13} {'share':>7} {'step+save s':>12}")
    for mode, m in medians.items():
        print(
            f"{mode:<6} {m['step_s']:8.3f} {m['checkpoint_s']:13.4f} {m['share']:7.1%} "
            f"{m['step_s'] + m['checkpoint_s']:12.3f}"
        )
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (results / f"checkpoint-{stamp}.json").write_text(
        json.dumps({"args": vars(args), "host": platform.node(), "runs": runs, "medians": medians}, indent=1)
    )


if __name__ == "__main__":
    main()
