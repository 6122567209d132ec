"""Reward functions as users write them, told apart by their signature (`inspect.signature`).

- The project's, per sample: ``fn(sample, text, metadata, **options) -> float``.
- TRL's, batched (GRPOTrainer's `reward_funcs` contract): ``fn(prompts, completions, **kwargs) -> list[float]``,
  recognised by a parameter named `prompts`, `completions` or `completion_ids` (or only ``**kwargs``). It is called
  with keyword arguments: `prompts` and `completions` as lists, `completion_ids` (the response token ids), every
  other column of the rows as a list of the same length (`answer`, `data_source`, ...), and the options. For chat
  data (the loader keeps a row's prompt messages in `metadata["prompt_messages"]`) a prompt is its message list and
  a completion is ``[{"role": "assistant", "content": text}]``; for text data a prompt is the text the model saw
  (`metadata["prompt"]`) and a completion the response text. A function without ``**kwargs``
  receives only the arguments it names. It is called once per batch (as TRL does), and `data.reward_timeout_s`
  limits that call. TRL's `trainer_state` is not passed. An entry of None counts as a failure here (TRL skips it).
  Beyond TRL: a function that names a `prompt_texts` parameter also gets the prompts as the model saw them (chat
  template applied: `metadata["prompt"]`), and an entry may be a `Failure` (that sample's call failed, with why).

A reward may expose `fn.validate_options(options)`: it raises ValueError naming a bad option and its fix, and is
called when the run's plugins are checked and when the reward is built (`check_options`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from megatron_rl.rollout.sample import Sample

Style = Literal["sample", "batched"]
BATCHED_NAMES = ("prompts", "completions", "completion_ids")
NAMED_ONLY = ("prompt_texts",)  # passed only to a function that names it (TRL's functions do not expect it)
NOT_COLUMNS = ("prompt", "prompt_messages")  # metadata keys that are not dataset columns for TRL


@dataclass
class RewardInput:
    """What one reward call sees of a sample: the sample (in a worker process a copy without its log-probs and routed
    experts, which rewards never read and cost most to send) and its decoded response."""

    sample: Sample
    text: str


@dataclass(frozen=True)
class Failure:
    """A reward call that raised, timed out or returned a non-number."""

    message: str
    timed_out: bool = False


@dataclass(frozen=True)
class RewardTask:
    """One reward call: `fn` on `items` (one for the per-sample style) with the keyword `options`; `answer_column`
    is the dataset's name of the answer column (TRL functions also get the answers under it)."""

    fn: Callable[..., Any]
    style: Style
    options: Mapping[str, Any]
    items: list[RewardInput]
    answer_column: str | None = None


Outcome = list[float | Failure] | Failure  # a value or Failure per item, or one Failure for the whole call


def run_task(task: RewardTask) -> Outcome:
    """Run one reward call; what it raises or returns that is not a number becomes a `Failure`."""
    try:
        return [checked_value(v) for v in call_reward(task)]
    except BaseException as err:  # noqa: BLE001 - any failure of user code is a failed call, not a crash
        return Failure(f"{type(err).__name__}: {err}")


def checked_value(value: object) -> float | Failure:
    """`value` as a float, or a Failure naming what it is (None, a string, NaN, ...); a Failure stays one."""
    if isinstance(value, Failure):
        return value
    if isinstance(value, numbers.Real) or (hasattr(type(value), "__float__") and not isinstance(value, (str, bytes))):
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:  # a tensor of several values, ...
            return Failure(f"returned {type(value).__name__} that is not one number ({err})")
        return number if math.isfinite(number) else Failure(f"returned {number}")
    shown = repr(value)
    shown = shown[:40] + "..." if len(shown) > 40 else shown
    return Failure(f"returned {shown} ({type(value).__name__}), not a number")


def reward_style(fn: Callable[..., Any], name: str) -> Style:
    """'sample' or 'batched' (see the module docstring); a ValueError naming both signatures otherwise."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume the project's
        return "sample"
    names = {p.name for p in parameters}
    if names & set(BATCHED_NAMES):
        return "batched"
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return "sample"
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return "batched"
    raise ValueError(
        f"reward {name!r} has the signature {inspect.signature(fn)}: write fn(sample, text, metadata) -> float or "
        "TRL's fn(prompts, completions, **kwargs) -> list[float]"
    )


def check_options(fn: Callable[..., Any], style: Style, options: Mapping[str, Any], name: str) -> None:
    """A ValueError when `fn` does not accept the keyword `options` of `data.reward`, or its `validate_options`
    refuses them."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        if style == "sample":
            signature.bind(None, "", {}, **options)
        elif not _takes_kwargs(signature):
            signature.bind_partial(**options)
    except TypeError as err:
        raise ValueError(f"reward {name!r} does not accept the options {dict(options)}: {err}") from err
    clash = sorted(set(options) & {*BATCHED_NAMES, *NAMED_ONLY}) if style == "batched" else []
    if clash:
        raise ValueError(f"reward {name!r}: the options {clash} are the names of TRL's arguments; rename them")
    validate = getattr(fn, "validate_options", None)
    if callable(validate):
        try:
            validate(dict(options))
        except ValueError as err:
            raise ValueError(f"reward {name!r}: {err}") from err


def call_reward(task: RewardTask) -> list:
    """The values the task's function returns (one per item, not yet checked)."""
    fn, items = task.fn, task.items
    if task.style == "sample":
        (item,) = items
        return [fn(item.sample, item.text, item.sample.metadata, **task.options)]
    values = fn(**trl_arguments(fn, items, task.answer_column), **task.options)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"returned a {type(values).__name__}, not a list of {len(items)} rewards")
    if len(values) != len(items):
        raise ValueError(f"returned {len(values)} rewards for {len(items)} completions")
    return list(values)


def trl_arguments(
    fn: Callable[..., Any], items: Sequence[RewardInput], answer_column: str | None = None
) -> dict[str, Any]:
    """TRL's keyword arguments for `items`: prompts, completions, completion_ids and every other column as lists
    (the reference answers as `answer` and under `answer_column`, the dataset's name for it)."""
    metadata = [item.sample.metadata for item in items]
    chat = all(isinstance(m.get("prompt_messages"), list) for m in metadata)
    arguments: dict[str, Any] = {
        "prompts": [m["prompt_messages"] if chat else m.get("prompt") for m in metadata],
        "completions": [[{"role": "assistant", "content": i.text}] if chat else i.text for i in items],
        "completion_ids": [list(i.sample.response_ids) for i in items],
    }
    columns = [k for k in dict.fromkeys(k for m in metadata for k in m) if k not in NOT_COLUMNS]
    arguments.update({k: [m.get(k) for m in metadata] for k in columns if k not in arguments})
    if answer_column and "." not in answer_column and answer_column not in arguments and "answer" in arguments:
        arguments[answer_column] = arguments["answer"]
    signature = inspect.signature(fn)
    if "prompt_texts" in signature.parameters:
        arguments["prompt_texts"] = [m.get("prompt") for m in metadata]
    if not _takes_kwargs(signature):
        arguments = {k: v for k, v in arguments.items() if k in signature.parameters}
    return arguments


def _takes_kwargs(signature: inspect.Signature) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
