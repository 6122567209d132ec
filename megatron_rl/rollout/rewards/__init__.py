"""Reward functions: a registry of built-ins, custom functions by dotted path, and timed, fault-tolerant scoring.

A reward function is ``fn(sample, text, metadata) -> float``: `text` is the decoded response (special tokens
skipped, so the stop token is not in it), `metadata` the sample's (it holds the reference "answer").
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from megatron_rl.rollout.plugins import lookup_callable, register_in
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.synthetic_task import synthetic_reward
from megatron_rl.rollout.synthetic_tool_task import tool_task_reward

logger = logging.getLogger(__name__)

RewardFn = Callable[[Sample, str, Mapping[str, Any]], float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` available as `get_reward(name)`."""
    return register_in(REWARD_FUNCTIONS, "reward", name)


def get_reward(name: str | RewardFn) -> RewardFn:
    """A registered name, a dotted path ("package.module:function" or "package.module.function"), or a callable."""
    return lookup_callable(name, REWARD_FUNCTIONS, "reward", "a function")


# ---------------------------------------------------------------------------------------------- built-ins
@register_reward("exact_match")
def exact_match(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the stripped response equals the stripped reference answer."""
    return float(text.strip() == str(metadata["answer"]).strip())


register_reward("synthetic")(synthetic_reward)
register_reward("synthetic_tool")(tool_task_reward)


@register_reward("math_answer")
def math_answer(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the response's final answer equals the reference: the last ``\\boxed{..}``, else the last
    "answer: X" / "answer is X", else the last number; compared numerically when both parse as numbers
    (integers, decimals, fractions, ``\\frac{a}{b}``), else as normalised strings. If the `math-verify` package
    is installed its verdict is also accepted (either check passing gives 1.0)."""
    reference = str(metadata["answer"])
    predicted = extract_final_answer(text)
    if predicted is not None and answers_match(predicted, _last_boxed(reference) or reference):
        return 1.0
    verify = _math_verify()
    return float(verify is not None and verify(reference, text))


_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\$?([^\n$]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def extract_final_answer(text: str) -> str | None:
    """The final answer in `text` (see `math_answer`), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None  # unbalanced braces


def answers_match(predicted: str, reference: str) -> bool:
    a, b = _as_number(predicted), _as_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return _normalise(predicted) == _normalise(reference)


def _normalise(s: str) -> str:
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|!|,|;|\s)", "", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).strip("$.").lower()


def _as_number(s: str) -> float | None:
    s = _normalise(s).replace(",", "")
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    try:
        if frac:
            value = Fraction(int(frac[2]), int(frac[3]))
            return float(-value if frac[1] else value)
        if s.endswith("%"):
            return float(s[:-1]) / 100
        return float(Fraction(s))
    except (ValueError, ZeroDivisionError):
        return None


@functools.cache
def _math_verify() -> Callable[[str, str], bool] | None:
    """`math_verify`'s check when the package is installed (optional, never a hard dependency)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None

    def check(reference: str, text: str) -> bool:
        # Its default timeouts use SIGALRM, which only works in the main thread; `compute_rewards` times out instead.
        gold, answer = parse(reference, parsing_timeout=None), parse(text, parsing_timeout=None)
        return bool(verify(gold, answer, timeout_seconds=None))

    return check


# ---------------------------------------------------------------------------------------------- scoring
@dataclass
class RewardStats:
    """Summary of one `compute_rewards` call (or several, merged with `+`)."""

    count: int = 0
    total: float = 0.0
    errors: int = 0  # reward function raised (reward set to 0.0)
    timeouts: int = 0  # reward function ran past the timeout (reward set to 0.0)
    first_error: str | None = None

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def __add__(self, other: RewardStats) -> RewardStats:
        return RewardStats(
            self.count + other.count,
            self.total + other.total,
            self.errors + other.errors,
            self.timeouts + other.timeouts,
            self.first_error or other.first_error,
        )


def compute_rewards(
    samples: list[Sample],
    fn: str | RewardFn,
    tokenizer,
    *,
    timeout_s: float = 10.0,
    max_workers: int = 8,
) -> RewardStats:
    """Score every sample (sets `sample.reward`) on up to `max_workers` daemon threads, each call with a `timeout_s`
    limit counted from its own start.

    A call that raises, returns a non-finite value, or runs past `timeout_s` gives 0.0; errors and timeouts are
    counted and logged once per call of this function. Each worker thread scores samples one after another (a
    thread per sample cost ~0.6 ms to start: 40 ms of a demo step). Python cannot kill a thread: a worker whose call
    hangs is abandoned (daemon, so it never blocks exit; its late result is discarded) and a new worker takes over
    the remaining samples, so a hung call stops counting against `max_workers`.
    """
    reward_fn = get_reward(fn)
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    done: queue.Queue[tuple[int, float | BaseException]] = queue.Queue()  # (index, reward or what it raised)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(samples)):
        todo.put(i)
    stats = RewardStats(count=len(samples))
    running: dict[int, tuple[int, float]] = {}  # worker -> (index it scores, start time); written by the worker
    abandoned: set[int] = set()
    resolved: set[int] = set()

    def work(worker: int) -> None:
        while worker not in abandoned:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            running[worker] = (i, time.monotonic())
            try:
                outcome: float | BaseException = float(reward_fn(samples[i], texts[i], samples[i].metadata))
            except BaseException as err:  # noqa: BLE001 - any failure of user code is a 0 reward, not a crash
                outcome = err
            running.pop(worker, None)
            done.put((i, outcome))

    workers = 0

    def start_worker() -> None:
        nonlocal workers
        threading.Thread(target=work, args=(workers,), name=f"reward-{workers}", daemon=True).start()
        workers += 1

    for _ in range(min(max_workers, len(samples))):
        start_worker()
    while len(resolved) < len(samples):
        calls = [(w, i, t) for w, (i, t) in list(running.items()) if w not in abandoned]
        wait = min((t + timeout_s for _, _, t in calls), default=time.monotonic() + timeout_s) - time.monotonic()
        try:
            i, outcome = done.get(timeout=max(wait, 0.0))
        except queue.Empty:
            now = time.monotonic()
            for w, i, t in calls:
                if now - t >= timeout_s and i not in resolved:
                    abandoned.add(w)
                    resolved.add(i)
                    samples[i].reward = 0.0
                    stats.timeouts += 1
                    stats.first_error = stats.first_error or f"timed out after {timeout_s} s"
                    start_worker()  # takes over the samples left to score
            continue
        if i in resolved:
            continue  # a late result of a call already timed out
        resolved.add(i)
        if isinstance(outcome, float) and not math.isfinite(outcome):
            outcome = ValueError(f"reward is {outcome}")
        if isinstance(outcome, BaseException):
            samples[i].reward = 0.0
            stats.errors += 1
            stats.first_error = stats.first_error or f"{type(outcome).__name__}: {outcome}"
        else:
            samples[i].reward = outcome
            stats.total += outcome
    if stats.errors or stats.timeouts:
        logger.warning(
            "reward %s: %d of %d calls raised and %d timed out (scored 0.0); first: %s",
            getattr(reward_fn, "__name__", fn),
            stats.errors,
            len(samples),
            stats.timeouts,
            stats.first_error,
        )
    return stats
