"""PPO with a learned critic on the embedded demo (P24) beside GRPO, from the same start.

From the demo's warmed-up model W (`distill_demo.warmed_model`), runs of `--steps` RL steps with the same seed:
``grpo`` (the grpo preset), ``ppo`` (the ppo preset: GAE with γ = λ = 1, the critic a baseline), ``ppo_td0`` (the
actor's λ = 0: each token's advantage is the critic's TD error, after `--warmup` critic-only steps) and its control
``ppo_td0_frozen`` (the same with the critic frozen, `algo.critic.lr=0`). Held-out greedy accuracy (256 prompts)
every `--eval-every` steps, the critic's explained variance per step, and each run's wall time.

    python benchmarks/ppo_demo.py [--steps 40] [--warmup 150] [--work DIR]
Results: a table on stdout, JSON and a PNG in benchmarks/results/ppo_<date>.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

from distill_demo import QUIET, ROOT, TRAIN, curve, rows, run, warmed_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--critic-lr", type=float, default=3e-4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ppo_demo_"))
    start_model = warmed_model(work)
    ppo = ("algo.preset=ppo", f"algo.critic.lr={args.critic_lr}")
    td0 = ("algo.preset=ppo", "algo.critic.lam_actor=0.0", f"algo.critic.warmup_steps={args.warmup}")
    runs = {
        "grpo": ("algo.preset=grpo",),
        "ppo": ppo,
        "ppo_td0": (*td0, f"algo.critic.lr={args.critic_lr}"),
        "ppo_td0_frozen": (*td0, "algo.critic.lr=0"),
    }
    curves, seconds = {}, {}
    for name, extra in runs.items():
        out = work / name
        if not (out / "metrics.jsonl").is_file():
            start = time.perf_counter()
            run([*TRAIN, f"trainer.output_dir={out}", f"model.hf_path={start_model}", "warmup.sft_steps=0",
                 f"trainer.steps={args.steps}", f"data.eval_every={args.eval_every}", *QUIET, *extra])  # fmt: skip
            (out / "wall_s.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
        curves[name], seconds[name] = rows(out), float((out / "wall_s.txt").read_text())
    evals = [r["step"] for r in curves["grpo"] if "eval/accuracy" in r]
    print(f"{'run':<15} " + " ".join(f"{'step ' + str(s):>9}" for s in evals) + f" {'wall s':>8} {'EV last':>8}")
    for name, history in curves.items():
        explained = list(curve(history, "critic/explained_variance").values())
        last = f"{explained[-1]:>8.3f}" if explained else f"{'-':>8}"
        print(f"{name:<15} " + " ".join(f"{r['eval/accuracy']:>9.3f}" for r in history if "eval/accuracy" in r)
              + f" {seconds[name]:>8.1f} {last}")  # fmt: skip
    stamp = datetime.date.today().strftime("%Y%m%d")
    results = ROOT / "benchmarks" / "results"
    summary = {
        "command": f"python benchmarks/ppo_demo.py --steps {args.steps} --warmup {args.warmup} "
        f"--critic-lr {args.critic_lr}",
        "machine": f"{os.cpu_count()} CPU cores",
        "runs": {
            name: {
                "overrides": list(runs[name]),
                "accuracy": curve(history, "eval/accuracy"),
                "explained_variance": curve(history, "critic/explained_variance"),
                "wall_s": seconds[name],
            }
            for name, history in curves.items()
        },
    }
    (results / f"ppo_{stamp}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, results / f"ppo_{stamp}.png")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, ev) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, curves) in enumerate(summary["runs"].items()):
        for axis, key in ((acc, "accuracy"), (ev, "explained_variance")):
            steps = sorted(curves[key], key=int)
            if steps:
                axis.plot([int(s) for s in steps], [curves[key][s] for s in steps], label=name, color=f"C{i}",
                          marker="o" if key == "accuracy" else None)  # fmt: skip
    acc.set(xlabel="RL step", ylabel="held-out greedy accuracy (256 prompts)", title="accuracy from the same start")
    ev.set(xlabel="RL step", ylabel="explained variance of the returns", title="the critic's fit (before each update)")
    acc.legend()
    ev.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
