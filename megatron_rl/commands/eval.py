"""`megatron-rl eval CONFIG [key=value ...] [--checkpoint PATH]`: score a model or checkpoint on the config's
evaluation datasets (`data.eval`) with the code `train` evaluates with.

`--checkpoint` is a Hugging Face model folder (e.g. a converted checkpoint or a run's `warmup_model`), a run's
checkpoint (`runs/x/checkpoints/step_000100`), or a run folder (its newest checkpoint); without it, model.hf_path.
It prints `eval/<name>/<metric>: value`, one a line (the one-dataset form of data.eval: `eval/<metric>`), and
writes eval_results.json, eval_results.md and eval_samples.jsonl. Several processes: `torchrun --nproc_per_node N
-m megatron_rl.cli eval ...` (the checkpoint is loaded into that layout).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (see examples/); data.eval says what is scored, and how")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. 'data.eval=[{name: g, path: x.jsonl}]'")
    parser.add_argument(
        "--checkpoint",
        help="an HF model folder, a run's checkpoint (checkpoints/step_N) or a run folder (its newest checkpoint); "
        "default: model.hf_path",
    )
    parser.add_argument(
        "--output", help="folder for the results; default: <run>/eval/<checkpoint> (<trainer.output_dir>/eval/...)"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_rl.api import evaluate

    result = evaluate(args.config, args.overrides, checkpoint=args.checkpoint, output_dir=args.output)
    if not result.metrics:  # ranks other than 0
        return 0
    for key, value in result.metrics.items():
        if key.startswith("eval/"):
            print(f"{key}: {value:.6g}")
    for key, value in result.metrics.items():
        if key.startswith("time/eval/") and key.count("/") == 2:
            print(f"{key}: {value:.2f} s")
    for path in result.files:
        print(f"wrote: {path}")
    return 0
