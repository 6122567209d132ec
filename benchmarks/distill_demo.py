"""On-policy distillation on the embedded demo (P22): a student distilled from a stronger teacher, against RL alone.

From the demo's warmed-up model W (the random demo model after the example's supervised warm-up):

* the teacher is W trained further: `--teacher-steps` GSPO steps of the demo, converted to HF;
* four runs start from W and train `--steps` steps each, with the same seed and settings:
  ``rl`` (the task reward alone, the demo's GSPO), ``distill`` (`algo.distill.task_rewards=false`: the per-token
  reverse KL to the teacher alone), ``rl+distill`` (both, `algo.distill.coef` 1) and ``top-k`` (top-k
  distillation's loss term alone: `algo.distill.top_k=8`, `coef=0`, no task reward).

Distillation runs with a token-level loss (`algo.loss=ppo`, clip 0.2/0.28, token-mean): GSPO weighs a sequence with
the token mean of its advantages, which averages the per-token signal away. Held-out greedy accuracy (256 prompts)
is evaluated every `--eval-every` steps; `distill/reverse_kl` is logged every step.

    python benchmarks/distill_demo.py [--steps 40] [--teacher-steps 100] [--work DIR]
Results: a table on stdout, JSON and a PNG in benchmarks/results/distill_<date>.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_moe_gspo.yaml"
TRAIN = [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE)]
QUIET = ("trainer.save_every=0", "logging.plot=false", "data.eval_prompts=256")
TOKEN_LEVEL = ("algo.loss=ppo", "algo.clip_low=0.2", "algo.clip_high=0.28", "algo.agg=token-mean")


def run(command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def curve(history: list[dict], key: str) -> dict[int, float]:
    """Metric `key` by step, over the rows of `history` that have it."""
    return {r["step"]: r[key] for r in history if key in r}


def warmed_model(work: Path) -> Path:
    """W: the demo's supervised warm-up of the random demo model (built in `work` once)."""
    warm_run = work / "warm_run"
    if not (warm_run / "warmup_model" / "config.json").is_file():
        run([*TRAIN, f"trainer.output_dir={warm_run}", f"model.hf_path={work / 'initial'}", "trainer.steps=1",
             "data.eval=null", "data.eval_every=0", *QUIET])  # fmt: skip
    return warm_run / "warmup_model"


def build_models(work: Path, teacher_steps: int) -> tuple[Path, Path]:
    """W (`warmed_model`) and the teacher (W after `teacher_steps` GSPO steps)."""
    teacher_run, teacher = work / "teacher_run", work / "teacher"
    student = warmed_model(work)
    if not (teacher / "config.json").is_file():
        run([*TRAIN, f"trainer.output_dir={teacher_run}", f"model.hf_path={student}", "warmup.sft_steps=0",
             f"trainer.steps={teacher_steps}", f"data.eval_every={teacher_steps}", *QUIET])  # fmt: skip
        run([sys.executable, "-m", "megatron_rl.cli", "convert", "megatron-to-hf", str(teacher_run / "checkpoints"),
             str(teacher), "--hf-extras", str(student)])  # fmt: skip
    return student, teacher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--teacher-steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="distill_demo_"))
    student, teacher = build_models(work, args.teacher_steps)
    runs = {
        "rl": (),
        "distill": (f"algo.distill.teacher={teacher}", "algo.distill.task_rewards=false"),
        "rl+distill": (f"algo.distill.teacher={teacher}",),
        "top-k": (f"algo.distill.teacher={teacher}", "algo.distill.task_rewards=false", "algo.distill.coef=0",
                  "algo.distill.top_k=8"),
    }
    curves: dict[str, list[dict]] = {}
    for name, extra in runs.items():
        out = work / name.replace("+", "_").replace("-", "")
        if not (out / "metrics.jsonl").is_file():
            run([*TRAIN, f"trainer.output_dir={out}", f"model.hf_path={student}", "warmup.sft_steps=0",
                 f"trainer.steps={args.steps}", f"data.eval_every={args.eval_every}", *QUIET, *TOKEN_LEVEL,
                 *extra])  # fmt: skip
        curves[name] = rows(out)
    teacher_accuracy = [r["eval/accuracy"] for r in rows(work / "teacher_run") if "eval/accuracy" in r][-1]
    print(f"teacher (W + {args.teacher_steps} GSPO steps): held-out accuracy {teacher_accuracy:.3f}")
    print(f"{'run':<12} " + " ".join(f"{'step ' + str(r['step']):>9}" for r in curves["rl"] if "eval/accuracy" in r))
    for name, history in curves.items():
        print(f"{name:<12} " + " ".join(f"{r['eval/accuracy']:>9.3f}" for r in history if "eval/accuracy" in r))
    stamp = datetime.date.today().strftime("%Y%m%d")
    results = ROOT / "benchmarks" / "results"
    summary = {
        "command": f"python benchmarks/distill_demo.py --steps {args.steps} --teacher-steps {args.teacher_steps}",
        "teacher_accuracy": teacher_accuracy,
        "runs": {
            name: {
                "accuracy": curve(history, "eval/accuracy"),
                "reverse_kl": curve(history, "distill/reverse_kl"),
                "topk_kl": curve(history, "distill/topk_kl"),
                "reward": curve(history, "rollout/reward_mean"),
            }
            for name, history in curves.items()
        },
    }
    (results / f"distill_{stamp}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, results / f"distill_{stamp}.png")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, kl) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (name, curves) in enumerate(summary["runs"].items()):
        steps = sorted(curves["accuracy"], key=int)
        acc.plot([int(s) for s in steps], [curves["accuracy"][s] for s in steps], marker="o", label=name, color=f"C{i}")
        if curves["reverse_kl"]:
            ks = sorted(curves["reverse_kl"], key=int)
            kl.plot([int(s) for s in ks], [curves["reverse_kl"][s] for s in ks], label=name, color=f"C{i}")
    acc.axhline(summary["teacher_accuracy"], color="gray", linestyle="--", label="teacher")
    acc.set(xlabel="RL step", ylabel="held-out greedy accuracy (256 prompts)", title="accuracy from the same start")
    kl.set(xlabel="RL step", ylabel="mean log pi_old - log pi_teacher", title="distill/reverse_kl")
    acc.legend()
    kl.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
