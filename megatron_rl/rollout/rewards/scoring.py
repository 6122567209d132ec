"""Scoring samples with one reward or a weighted sum of several, where a timeout can be enforced, and the failure
limit.

Where each reward runs: the cheap built-ins that cannot hang (`register_reward(..., inline=True)`: exact_match,
synthetic, synthetic_tool) in the calling thread; every other function in a pool of killable worker processes
(`worker_pool`), a call past `timeout_s` killed with its worker; a function that cannot be pickled (a closure, a
lambda, one defined in `__main__`) in daemon threads, where a call past `timeout_s` is abandoned, not killed (logged
once per function).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import pickle
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from megatron_rl.optional_deps import require
from megatron_rl.rollout.rewards import math_rewards
from megatron_rl.rollout.rewards.registry import INLINE_REWARDS, REQUIRED_MODULES, REWARD_FUNCTIONS, get_reward
from megatron_rl.rollout.rewards.thread_runner import run_in_threads
from megatron_rl.rollout.rewards.user_functions import (
    Failure,
    Outcome,
    RewardInput,
    RewardTask,
    Style,
    check_options,
    reward_style,
    run_task,
)
from megatron_rl.rollout.rewards.worker_pool import shared_pool
from megatron_rl.rollout.sample import Sample

if TYPE_CHECKING:  # the config imports torch; worker processes import this module and need neither
    from megatron_rl.config.schema import DataConfig, RewardSpec

logger = logging.getLogger("megatron_rl.rollout.rewards")
Runner = Literal["inline", "process", "thread"]


@dataclass
class RewardStats:
    """Summary of one scoring call (or several, merged with `+`); a failed call scores 0."""

    count: int = 0
    total: float = 0.0  # sum of the samples' (weighted) rewards
    errors: int = 0  # calls that raised or returned a non-number
    timeouts: int = 0  # calls that ran past the timeout
    first_error: str | None = None
    part_totals: dict[str, float] = field(default_factory=dict)  # reward name -> sum of its unweighted values
    part_failures: dict[str, int] = field(default_factory=dict)  # reward name -> failed calls
    failure_limit: float | None = None

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def __add__(self, other: RewardStats) -> RewardStats:
        def merged(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, Any]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        return RewardStats(
            self.count + other.count,
            self.total + other.total,
            self.errors + other.errors,
            self.timeouts + other.timeouts,
            self.first_error or other.first_error,
            merged(self.part_totals, other.part_totals),
            merged(self.part_failures, other.part_failures),
            self.failure_limit if self.failure_limit is not None else other.failure_limit,
        )

    def metrics(self) -> dict[str, float]:
        """`reward/<name>_mean` and `reward/<name>_errors` per named reward, and `reward/failure_limit`."""
        out: dict[str, float] = {}
        for name, total in self.part_totals.items():
            out[f"reward/{name}_mean"] = total / self.count if self.count else 0.0
            out[f"reward/{name}_errors"] = float(self.part_failures.get(name, 0))
        if self.failure_limit is not None:
            out["reward/failure_limit"] = float(self.failure_limit)
        return out


class RewardFailureError(ValueError):
    """More than `data.reward_failure_limit` of one batch's calls of one reward (of a weighted list: each is counted
    apart) raised, timed out or returned a non-number."""


@dataclass(frozen=True)
class RewardPart:
    """One reward of a `RewardSet`: `name` keys its metrics and `Sample.reward_parts`, `label` is as configured."""

    name: str
    label: str
    fn: Callable[..., Any]
    weight: float
    options: Mapping[str, Any]
    style: Style
    runner: Runner


class RewardSet:
    """Scores samples: `sample.reward = sum(weight * value)` over the parts, each value in `sample.reward_parts`."""

    def __init__(self, parts: Sequence[RewardPart], *, failure_limit: float | None = None, answer_column: str = ""):
        if not parts:
            raise ValueError("data.reward is an empty list: name at least one reward")
        self.parts = tuple(parts)
        self.failure_limit = failure_limit
        self.answer_column = answer_column
        self._extractor = _answer_extractor(self.parts)

    @classmethod
    def from_specs(
        cls,
        specs: Iterable[RewardSpec | str | Callable[..., Any]],
        *,
        failure_limit: float | None = None,
        answer_column: str = "",
    ) -> RewardSet:
        """Resolve each reward (name, import path or callable), check its signature and options and what it needs."""
        from megatron_rl.config.schema import RewardSpec

        parts: list[RewardPart] = []
        for spec in specs:
            fn = None
            if isinstance(spec, str):
                spec = RewardSpec(spec)
            elif not isinstance(spec, RewardSpec):
                fn, spec = spec, RewardSpec(_label(spec))
            parts.append(_part(spec, {p.name for p in parts}, fn))
        return cls(parts, failure_limit=failure_limit, answer_column=answer_column)

    @property
    def extracts_answers(self) -> bool:
        """Whether a part's function exposes `extract_answer` (then evaluation reports maj@k)."""
        return self._extractor is not None

    def extract_answer(self, sample: Sample, text: str) -> str | None:
        """The response's final answer in canonical form, the key maj@k votes on: `fn.extract_answer(text)` of the
        first part (in list order) whose function has one, called with `sample=` when it names that parameter and
        with the part's options it names (gsm8k's `strict`); None when no part has one or it finds no answer. It runs
        here, without the reward's timeout. A ValueError names the reward when it raises or returns a non-string."""
        if self._extractor is None:
            return None
        part, extract, takes_sample, options = self._extractor
        keywords = {**options, "sample": sample} if takes_sample else dict(options)
        try:
            answer = extract(text, **keywords)
        except Exception as err:  # noqa: BLE001 - user code raises anything; named, not swallowed
            raise ValueError(
                f"reward {part.label!r}: extract_answer raised {type(err).__name__}: {_one_line(str(err), 200)}"
            ) from err
        if answer is not None and not isinstance(answer, str):
            raise ValueError(
                f"reward {part.label!r}: extract_answer returned {_shown(answer, 40)} ({type(answer).__name__}); "
                "return the answer as a str, or None when there is none"
            )
        return answer

    @property
    def routes_by_data_source(self) -> bool:
        """Whether a part picks its reward by the rows' `data_source` (`auto`): see `check_data_sources`."""
        return any(part.fn is math_rewards.auto for part in self.parts)

    def check_data_sources(self, sources: set[str]) -> None:
        """Refuse data whose `data_source` values a part cannot route (`auto`); a ValueError naming them."""
        if self.routes_by_data_source:
            math_rewards.check_auto_sources(sources)

    def __call__(self, sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
        """The weighted sum for one sample, in this thread (no timeout); a failed part raises ValueError."""
        total = 0.0
        for part in self.parts:
            outcome = run_task(
                RewardTask(part.fn, part.style, part.options, [RewardInput(sample, text)], self.answer_column)
            )
            value = outcome if isinstance(outcome, Failure) else outcome[0]
            if isinstance(value, Failure):
                raise ValueError(f"reward {part.label!r}: {value.message}")
            total += part.weight * value
        return total

    def score(
        self,
        samples: list[Sample],
        tokenizer: Any,
        *,
        timeout_s: float = 10.0,
        max_workers: int = 8,
        failure_limit: float | None = None,
    ) -> RewardStats:
        """Set every sample's `reward` and `reward_parts`; a failed call scores 0, is counted and logged (once per
        call of this method); more failures than the limit (`failure_limit`, else the set's) raise
        RewardFailureError."""
        limit = self.failure_limit if failure_limit is None else failure_limit
        texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        values = {part.name: self._run(part, samples, texts, timeout_s, max_workers) for part in self.parts}
        stats = RewardStats(count=len(samples), failure_limit=limit)
        for i, sample in enumerate(samples):
            sample.reward_parts = {}
            for part in self.parts:
                value = values[part.name][i]
                sample.reward_parts[part.name] = 0.0 if isinstance(value, Failure) else value
            sample.reward = sum(part.weight * sample.reward_parts[part.name] for part in self.parts)
            stats.total += sample.reward
        for part in self.parts:
            failures = [(i, v) for i, v in enumerate(values[part.name]) if isinstance(v, Failure)]
            stats.part_totals[part.name] = sum(s.reward_parts[part.name] for s in samples)
            stats.part_failures[part.name] = len(failures)
            stats.timeouts += sum(f.timed_out for _, f in failures)
            stats.errors += sum(not f.timed_out for _, f in failures)
            if failures:
                stats.first_error = stats.first_error or failures[0][1].message
            if limit is not None and len(failures) > limit * len(samples):
                raise RewardFailureError(_failure_message(part, failures, len(samples), limit, samples, texts))
        if stats.errors or stats.timeouts:
            logger.warning(
                "reward %s: %d of %d calls raised or returned a non-number and %d timed out (scored 0.0); first: %s",
                "+".join(p.label for p in self.parts),
                stats.errors,
                len(samples) * len(self.parts),
                stats.timeouts,
                stats.first_error,
            )
        return stats

    def _run(
        self, part: RewardPart, samples: list[Sample], texts: list[str], timeout_s: float, max_workers: int
    ) -> list[float | Failure]:
        """One value or Failure per sample for `part`."""
        if not samples:
            return []
        workers = 1 if part.runner == "inline" else min(max_workers, os.cpu_count() or 1, max(len(samples), 1))
        light = part.runner == "process"
        inputs = [RewardInput(_light(s) if light else s, t) for s, t in zip(samples, texts, strict=True)]
        # A batched (TRL) function gets the whole batch in one call, as TRL calls it; `timeout_s` limits that call.
        groups = [[x] for x in inputs] if part.style == "sample" else [inputs]
        tasks = [RewardTask(part.fn, part.style, part.options, g, self.answer_column) for g in groups]
        if part.runner == "inline":
            outcomes = [run_task(t) for t in tasks]
        elif part.runner == "process":
            outcomes = shared_pool(workers).run(tasks, timeout_s)
        else:
            outcomes = run_in_threads(tasks, timeout_s, workers)
        return _flatten(tasks, outcomes)


def build_reward(data: DataConfig) -> RewardSet:
    """The run's reward from its `data` section: `data.reward` (a name or weighted list), the failure limit."""
    return RewardSet.from_specs(
        data.reward_specs(), failure_limit=data.reward_failure_limit, answer_column=data.answer_key or ""
    )


def compute_rewards(
    samples: list[Sample],
    fn: str | Callable[..., Any] | RewardSet,
    tokenizer: Any,
    *,
    timeout_s: float = 10.0,
    max_workers: int = 8,
    failure_limit: float | None = None,
) -> RewardStats:
    """Score `samples` with `fn` (a `RewardSet`, a reward name or import path, or a function): `RewardSet.score`.
    `failure_limit` None: the set's limit (none for a name or function)."""
    reward = fn if isinstance(fn, RewardSet) else RewardSet.from_specs([fn])
    return reward.score(samples, tokenizer, timeout_s=timeout_s, max_workers=max_workers, failure_limit=failure_limit)


def check_data_sources(reward: RewardSet, sources: set[str]) -> None:
    """`reward.check_data_sources(sources)`: refuse `data_source` values the reward cannot route."""
    reward.check_data_sources(sources)


# ---------------------------------------------------------------------------------------------- parts
_THREAD_NOTED: weakref.WeakSet = weakref.WeakSet()


def _part(spec: RewardSpec, taken: set[str], fn: Callable[..., Any] | None = None) -> RewardPart:
    fn = fn or get_reward(spec.name)
    if spec.name in REQUIRED_MODULES:
        require(REQUIRED_MODULES[spec.name])  # one line naming the extra, when the run starts
    style = reward_style(fn, spec.name)
    check_options(fn, style, spec.options, spec.name)
    if spec.name in INLINE_REWARDS:
        runner: Runner = "inline"
    elif _picklable(fn, spec.options):
        runner = "process"
    else:
        runner = "thread"
        if fn not in _THREAD_NOTED:
            _THREAD_NOTED.add(fn)
            logger.warning(
                "reward %s cannot be sent to a worker process (a closure, a lambda or defined in __main__?): it runs "
                "in threads, where a call past data.reward_timeout_s is abandoned, not killed; define it in a module "
                "for an enforced timeout",
                spec.name,
            )
    return RewardPart(_metric_name(spec.name, taken), spec.name, fn, spec.weight, spec.options, style, runner)


_Extractor = tuple[RewardPart, Callable[..., Any], bool, Mapping[str, Any]]  # part, function, takes sample=, options


def _answer_extractor(parts: Sequence[RewardPart]) -> _Extractor | None:
    """The first part whose function has `extract_answer`, with what to pass it (see `RewardSet.extract_answer`)."""
    for part in parts:
        extract = getattr(part.fn, "extract_answer", None)
        if extract is None:
            continue
        if not callable(extract):
            raise ValueError(
                f"reward {part.label!r}: its extract_answer is a {type(extract).__name__}; set it to a function "
                "(text) -> str | None"
            )
        try:
            signature = inspect.signature(extract)
        except (TypeError, ValueError):  # a builtin without a signature: the text only
            return part, extract, False, {}
        named = signature.parameters
        anything = any(p.kind == p.VAR_KEYWORD for p in named.values())
        takes_sample = anything or "sample" in named
        options = {k: v for k, v in part.options.items() if anything or k in named}
        try:
            signature.bind("", **options, **({"sample": None} if takes_sample else {}))
        except TypeError as err:
            raise ValueError(
                f"reward {part.label!r}: its extract_answer{signature} cannot be called as extract_answer(text) "
                f"({err}); write it as (text, *, sample=None) -> str | None"
            ) from err
        return part, extract, takes_sample, options
    return None


def _picklable(fn: Callable[..., Any], options: Mapping[str, Any]) -> bool:
    if getattr(fn, "__module__", None) == "__main__":
        return False  # a worker's __main__ is not the user's script
    try:
        pickle.dumps((fn, dict(options)))
    except Exception:  # noqa: BLE001 - pickling raises many kinds (PicklingError, AttributeError, TypeError)
        return False
    return True


def _label(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _metric_name(label: str, taken: set[str]) -> str:
    """The registered name, or an import path's last part; `_2`, `_3`, ... when taken."""
    base = label if label in REWARD_FUNCTIONS else re.split(r"[:.]", label)[-1]
    base = re.sub(r"\W", "_", base) or "reward"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def _light(sample: Sample) -> Sample:
    """A copy without what rewards never read and is costly to send: log-probs and routed experts."""
    light = copy.copy(sample)
    light.response_log_probs = []
    light.routed_experts = None
    return light


def _flatten(tasks: Sequence[RewardTask], outcomes: Sequence[Outcome]) -> list[float | Failure]:
    """Per item: a whole-call Failure applies to each item of its call."""
    values: list[float | Failure] = []
    for task, outcome in zip(tasks, outcomes, strict=True):
        values.extend([outcome] * len(task.items) if isinstance(outcome, Failure) else outcome)
    return values


def _failure_message(
    part: RewardPart, failures: list[tuple[int, Failure]], n: int, limit: float, samples: list[Sample], texts: list[str]
) -> str:
    i, first = failures[0]
    prompt = samples[i].metadata.get("prompt", "")
    # An inline reward's timeouts are its own (remote: options.timeout_s), not data.reward_timeout_s.
    slow = "raise data.reward_timeout_s, " if part.runner != "inline" and any(f.timed_out for _, f in failures) else ""
    return (
        f"reward {part.label!r} failed on {len(failures)} of {n} samples of a batch (raised, timed out or returned a "
        f"non-number), more than data.reward_failure_limit={limit:g}; the first: {_one_line(first.message, 200)} on "
        f"the sample with prompt {_shown(prompt)} and response {_shown(texts[i])}. Fix the function, {slow}or raise "
        "data.reward_failure_limit to train on with failed calls scored 0"
    )


def _one_line(s: str, limit: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _shown(s: object, limit: int = 80) -> str:
    text = str(s)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
