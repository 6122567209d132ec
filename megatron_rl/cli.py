"""`megatron-rl` command line: one subcommand per job, each implemented in its own module.

Subcommand modules are imported only when that subcommand runs, so `megatron-rl --help` stays fast
and does not import Megatron-Core.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Sequence

from megatron_rl import __version__
from megatron_rl.optional_deps import MissingOptionalDependency

# name -> (module exposing `add_arguments(parser)` and `run(args) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_rl.commands.train", "RL training from a YAML config with dotted overrides"),
    "eval": ("megatron_rl.commands.eval", "score a model or checkpoint on the config's evaluation datasets"),
    "sft": ("megatron_rl.commands.sft", "the supervised warm-up (SFT) of a config alone, saved as an HF model"),
    "logprobs": ("megatron_rl.commands.logprobs", "score tokens: per-token log-probs, entropy and routed experts"),
    "launch": ("megatron_rl.commands.launch", "plan a multi-node job: which node runs what, and whether it fits"),
    "convert": ("megatron_rl.commands.convert", "convert checkpoints: Hugging Face <-> Megatron distributed"),
    "doctor": ("megatron_rl.commands.doctor", "print what is installed and usable here"),
    "models": ("megatron_rl.commands.models", "list the supported model families and what each supports"),
    "rewards": ("megatron_rl.commands.rewards", "list the built-in rewards and the reward signatures accepted"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="RL post-training of Mixture-of-Experts LLMs on Megatron-Core.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-rl {__version__}")
    parser.add_argument(
        "--traceback",
        "--debug",
        action="store_true",
        help="on an input error, show the full Python traceback instead of the one-line message (for developers)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here (also after --help), not at interpreter exit
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a pipe to some helper process broke: a real failure, not `| head`
        # The reader of our output went away (`megatron-rl train --help-config | head`): stop quietly, as Unix
        # tools do. Python's recipe: point stdout at devnull so the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports POLLERR on such a pipe's write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # stdout closed or not a real file
        return True


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (ValueError, FileNotFoundError, MissingOptionalDependency) as err:
        # Bad input (config, checkpoint, data, layout): the message names the problem and the fix. Every error
        # type the project raises for bad input is a ValueError (ConfigError, CheckpointError, ...).
        if args.traceback:
            raise
        print(f"megatron-rl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        # A check that stops the run on purpose (e.g. sync_probe.WeightSyncMismatch) says why in its message.
        if args.traceback or not getattr(err, "stops_run", False):
            raise
        print(f"megatron-rl {args.command}: stopped: {err}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
