"""`megatron-rl rewards`: every registered reward with where it runs, whether evaluation can report maj@k with it (it
exposes `extract_answer`), what it scores, and the signatures `data.reward` accepts."""

from __future__ import annotations

import argparse
import importlib
import inspect

SIGNATURES = (
    ("fn(sample, text, metadata, **options) -> float", "per sample: text = the decoded response, metadata = the "
     "row (answer, prompt, data_source, ...)"),
    ("fn(prompts, completions, **kwargs) -> list[float]", "TRL's batched reward_funcs: completions are strings, or "
     "[{role, content}] lists for chat data; every other column and completion_ids as keyword lists"),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module first, so the rewards it registers are listed too (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from megatron_rl.rollout.rewards import get_reward
    from megatron_rl.rollout.rewards.registry import INLINE_REWARDS, REQUIRED_MODULES, REWARD_FUNCTIONS

    for module in args.plugin:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(f"--plugin {module}: cannot import it ({err})") from err
    first_name: dict[int, str] = {}  # function -> the first name it was registered under (later ones are aliases)
    for name in REWARD_FUNCTIONS:
        first_name.setdefault(id(get_reward(name)), name)
    rows = [("name", "where it runs", "maj@k", "what it scores")]
    for name in sorted(REWARD_FUNCTIONS):
        fn = get_reward(name)
        where = "inline" if name in INLINE_REWARDS else "worker process"
        if name in REQUIRED_MODULES:
            where += f", needs {REQUIRED_MODULES[name]}"
        primary = first_name[id(fn)]
        votes = "yes" if callable(getattr(fn, "extract_answer", None)) else "no"
        rows.append((name, where, votes, summary(fn) if primary == name else f"an alias of {primary}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for name, where, votes, what in rows:
        print(f"{name:<{widths[0]}}  {where:<{widths[1]}}  {votes:<{widths[2]}}  {what}")
    print("\ndata.reward: one of these names, an import path 'package.module:function', or a list of")
    print("{name, weight, options} summed with their weights (options: keyword arguments of every call).")
    print("maj@k yes: the function has an attribute extract_answer(text) -> str | None, the answer majority")
    print("voting counts; give your own one by `my_reward.extract_answer = my_extractor`.")
    print("A function is recognised by its signature:")
    for signature, meaning in SIGNATURES:
        print(f"  {signature:<52}  {meaning}")
    return 0


def summary(fn: object, limit: int = 110) -> str:
    """The first paragraph of `fn`'s docstring on one line, shortened to `limit` characters."""
    first = " ".join((inspect.getdoc(fn) or "(no docstring)").split("\n\n")[0].split())
    return first if len(first) <= limit else first[: limit - 3] + "..."
