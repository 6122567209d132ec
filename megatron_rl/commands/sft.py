"""`megatron-rl sft CONFIG [key=value ...]`: the supervised warm-up of a config alone, no RL steps.

It runs `warmup.sft_steps` steps on `warmup.data` (default `data.train`) exactly as `train` warms up, writes the
model in Hugging Face format to `<trainer.output_dir>/warmup_model` and prints where: point `model.hf_path` of an
RL run at it. A stopped or crashed run resumes mid-SFT from its checkpoints (every `warmup.save_every` SFT steps).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (see examples/); the warmup and data sections say what trains")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. warmup.sft_steps=200 warmup.data=x.jsonl")


def run(args: argparse.Namespace) -> int:
    from megatron_rl.config import check_input_paths, load_config

    cfg = load_config(args.config, args.overrides)
    check_input_paths(cfg)  # model, tokenizer and data files exist: fail before the model is built
    from megatron_rl.trainer.guards.stop_signals import TrainingAborted
    from megatron_rl.trainer.logs.run_dir import resume_command
    from megatron_rl.trainer.sft_only import sft
    from megatron_rl.trainer.warmup import SFT_PLOT

    command = resume_command(cfg, args.config, args.overrides).replace("megatron-rl train ", "megatron-rl sft ", 1)
    try:
        result = sft(cfg, resume_command=command)
    except TrainingAborted as aborted:  # a signal outside a step boundary: one line, no traceback
        print(aborted, file=sys.stderr, flush=True)
        return aborted.exit_code
    if result.stopped_by is not None:  # stopped at a step boundary; the warm-up said where
        return 128 + result.stopped_by
    if result.rows:
        first, last = result.rows[0], result.rows[-1]
        print(f"sft/nll: {first['sft/nll']:.3f} (step {first['sft_step']}) -> {last['sft/nll']:.3f} "
              f"(step {last['sft_step']})")  # fmt: skip
    print(f"SFT model: {result.model_dir} (start RL from it with model.hf_path={result.model_dir})")
    plot = result.output_dir / SFT_PLOT
    if plot.is_file():
        print(f"plot: {plot}")
    return 0
