"""LoRA RL on the embedded demo (P23) against full fine-tuning, from the same start.

From the demo's warmed-up model W (`distill_demo.warmed_model`), two GSPO runs of `--steps` steps with the same seed:
``full`` (every weight trains, the demo's lr 1e-4) and ``lora`` (`model.lora.rank`, adapters on attention and the
experts, the base frozen, lr `--lora-lr`: adapters start at B = 0 and take a larger step, as is usual for LoRA).
Held-out greedy accuracy (256 prompts) every `--eval-every` steps, the wall time of each run, and the training state
each needs (parameters that train, their gradients and Adam moments: bytes on this one-process CPU layout, measured
on the built actors after one update) side by side.

    python benchmarks/lora_demo.py [--steps 40] [--rank 16] [--work DIR]
Results: a table on stdout, JSON and a PNG in benchmarks/results/lora_<date>.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distill_demo import QUIET, ROOT, TRAIN, curve, rows, run, warmed_model

TARGETS = "[attention,experts]"


def train_state_bytes(model_dir: Path, rank: int) -> dict[str, int]:
    """Bytes of the trained state on the built actor (one process): trainable parameters, their gradient buffers and
    the optimizer's state, after one update; with `rank` > 0, LoRA of that rank on TARGETS."""
    code = f"""
import json, os, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from megatron_rl.config.options import LoRAOptions, OptimizerOptions
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.distributed import init_distributed
from megatron_rl.parallel_layout import ParallelLayout
init_distributed(ParallelLayout(), seed=1)
lora = LoRAOptions(rank={rank}, targets=("attention", "experts")) if {rank} else None
actor = MegatronActor.from_hf({str(model_dir)!r}, ParallelLayout(), lora=lora, optimizer_options=OptimizerOptions())
ids = torch.randint(4, 20, (4, 12))
batch = TokenBatch(ids, torch.full((4,), 12), torch.full((4,), 4))
actor.train_step(batch, lambda lp, ent, mb: ((lp * mb.response_mask()).sum(), torch.tensor(1), {{}}))
params = [p for c in actor.chunks for p in c.parameters()]
trained = [p for p in params if p.requires_grad]
nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
from megatron_rl.megatron_backend.actor.training_setup import inner_optimizers
states = [s for opt in inner_optimizers(actor.optimizer) for s in opt.state.values()]
state = [t for s in states for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
print(json.dumps({{"weights": nbytes(params), "trained_params": nbytes(trained),
                  "grads": nbytes([p.main_grad for p in trained]), "optimizer": nbytes(state)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="lora_demo_"))
    student = warmed_model(work)
    runs = {
        "full": (),
        "lora": (f"model.lora.rank={args.rank}", f"model.lora.targets={TARGETS}", f"optimizer.lr={args.lora_lr}"),
    }
    curves, seconds = {}, {}
    for name, extra in runs.items():
        out = work / name
        if not (out / "metrics.jsonl").is_file():
            start = time.perf_counter()
            run([*TRAIN, f"trainer.output_dir={out}", f"model.hf_path={student}", "warmup.sft_steps=0",
                 f"trainer.steps={args.steps}", f"data.eval_every={args.eval_every}", *QUIET, *extra])  # fmt: skip
            (out / "wall_s.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
        curves[name], seconds[name] = rows(out), float((out / "wall_s.txt").read_text())
    memory = {"full": train_state_bytes(student, 0), "lora": train_state_bytes(student, args.rank)}
    print(f"{'run':<6} " + " ".join(f"{'step ' + str(r['step']):>9}" for r in curves["full"] if "eval/accuracy" in r)
          + f" {'wall s':>8} {'trained KiB':>12} {'grads KiB':>10} {'Adam KiB':>9}")  # fmt: skip
    for name, history in curves.items():
        m = memory[name]
        print(f"{name:<6} " + " ".join(f"{r['eval/accuracy']:>9.3f}" for r in history if "eval/accuracy" in r)
              + f" {seconds[name]:>8.1f} {m['trained_params'] / 1024:>12.1f} {m['grads'] / 1024:>10.1f}"
              f" {m['optimizer'] / 1024:>9.1f}")  # fmt: skip
    stamp = datetime.date.today().strftime("%Y%m%d")
    results = ROOT / "benchmarks" / "results"
    summary = {
        "command": f"python benchmarks/lora_demo.py --steps {args.steps} --rank {args.rank} --lora-lr {args.lora_lr}",
        "machine": f"{os.cpu_count()} CPU cores",
        "runs": {
            name: {
                "accuracy": curve(history, "eval/accuracy"),
                "reward": curve(history, "rollout/reward_mean"),
                "wall_s": seconds[name],
                "train_state_bytes": memory[name],
            }
            for name, history in curves.items()
        },
    }
    (results / f"lora_{stamp}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, results / f"lora_{stamp}.png")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, mem) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (name, curves) in enumerate(summary["runs"].items()):
        steps = sorted(curves["accuracy"], key=int)
        acc.plot([int(s) for s in steps], [curves["accuracy"][s] for s in steps], marker="o", label=name, color=f"C{i}")
    acc.set(xlabel="RL step", ylabel="held-out greedy accuracy (256 prompts)", title="accuracy from the same start")
    acc.legend()
    names = list(summary["runs"])
    parts = ["trained_params", "grads", "optimizer"]
    bottom = [0.0] * len(names)
    for part in parts:
        values = [summary["runs"][n]["train_state_bytes"][part] / 1024 for n in names]
        mem.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    mem.set(ylabel="KiB (one process, fp32)", title="training state: trained weights, grads, Adam")
    mem.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
