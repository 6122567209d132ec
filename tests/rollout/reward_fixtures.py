"""Reward functions as users write them, in a module (so the scorer's worker processes can import them): the
reward tests and the end-to-end run (`data.reward=tests.rollout.reward_fixtures:always_raises`) use them."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from megatron_rl.rollout.sample import Sample


def always_raises(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    raise KeyError("ground_truth")


def marked(sample: Sample, text: str, metadata: Mapping[str, Any], *, bonus: float = 0.0) -> Any:
    """Per the row's "kind": ok -> len(text) + bonus, raise, hang (forever), none, text (a string), nan."""
    kind = metadata.get("kind", "ok")
    if kind == "raise":
        raise RuntimeError(f"cannot score {text!r}")
    if kind == "hang":
        threading.Event().wait()  # never returns: only killing the worker ends it
    if kind == "none":
        return None
    if kind == "text":
        return "1.0"
    if kind == "nan":
        return float("nan")
    return len(text) + bonus


def worker_pid(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """The process that scored the sample."""
    return float(os.getpid())


def trl_length(prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
    """TRL's example 1: longer completions (in tokens) score more."""
    return [float(len(ids)) for ids in completion_ids]


def trl_exact(completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """TRL-style accuracy: text or chat completions; None where a row has no answer."""
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if a is None else float(c.strip() == a) for c, a in zip(contents, answer, strict=True)]


def trl_named(prompts: list, completions: list, ground_truth: list, data_source: list) -> list[float]:
    """Names its columns without **kwargs: it gets only those."""
    return [float(c == g) for c, g in zip(completions, ground_truth, strict=True)]


def trl_wrong_length(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    return [1.0]


def two_positional(sample: Sample, text: str) -> float:
    return 0.0


def raises_on_eval(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """The synthetic task's reward on training rows; raises on rows marked split=eval (the evaluation's file)."""
    if metadata.get("split") == "eval":
        raise ValueError("no scorer for evaluation rows")
    return float(sample.finish_reason == "stop" and text.strip() == metadata["answer"])
