"""`megatron-rl` command line: one subcommand per job, each implemented in its own module.

Subcommand modules are imported only when that subcommand runs, so `megatron-rl --help` stays fast
and does not import Megatron-Core.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from megatron_rl import __version__

# name -> (module exposing `add_arguments(parser)` and `run(args) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "logprobs": ("megatron_rl.commands.logprobs", "score tokens: per-token log-probs, entropy and routed experts"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="RL post-training of Mixture-of-Experts LLMs on Megatron-Core.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-rl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
