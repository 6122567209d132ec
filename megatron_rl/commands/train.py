"""`megatron-rl train CONFIG [key=value ...]`: run RL training from a YAML config with dotted overrides.

A thin face over the Python entry point `megatron_rl.train` (`megatron_rl/api.py`): the same function runs.

Single process: `megatron-rl train examples/tiny_moe_gspo.yaml`.
Several processes (tensor/expert/pipeline/data parallel): `torchrun --nproc_per_node N -m megatron_rl.cli train ...`.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (see examples/); omit with --help-config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.preset=sapo rollout.n_samples=4")
    parser.add_argument("--help-config", action="store_true", help="print every config key with help and exit")
    parser.add_argument(
        "--verbose", action="store_true", help="print the whole resolved config at start-up (else a short header)"
    )


def run(args: argparse.Namespace) -> int:
    if args.help_config:
        from megatron_rl.config import config_help

        print(config_help())
        return 0
    if args.config is None:
        raise ValueError("a config file is required, e.g. megatron-rl train examples/tiny_moe_gspo.yaml")
    from megatron_rl.api import train
    from megatron_rl.trainer.guards.stop_signals import TrainingAborted, under_torchrun

    try:
        result = train(args.config, args.overrides, verbose=args.verbose)
    except TrainingAborted as aborted:  # a signal outside a step boundary: one line, no traceback
        print(aborted, file=sys.stderr, flush=True)
        return aborted.exit_code
    if result.stopped_by is not None:  # stopped cleanly at a step boundary; the loop said where
        # Under torchrun a worker that stopped and saved as asked exits 0: torchrun's agent reports any other code
        # as a failed worker (a ChildFailedError report) when the signal reached the workers only.
        return 0 if under_torchrun() else 128 + result.stopped_by
    if result.history:
        from megatron_rl.trainer.logs.plots import eval_headlines

        last = result.history[-1]
        headlines = eval_headlines({k for row in result.history for k in row}).values()
        for key in ("eval/accuracy", *headlines, "rollout/reward_mean"):
            before = next((r[key] for r in result.history if key in r), None)
            if before is not None and key in last:
                print(f"{key}: {before:.3f} (first) -> {last[key]:.3f} (last)")
    for plot in result.plots:
        print(f"plot: {plot}")
    return 0
