"""Reward registry, built-in rewards and `compute_rewards` (errors, timeouts, late results)."""

from __future__ import annotations

import logging
import threading

import pytest

from megatron_rl.rollout import rewards
from megatron_rl.rollout.rewards import compute_rewards, extract_final_answer, get_reward, math_answer, math_rewards
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.tasks import synthetic_task


def _sample(text_ids: list[int] | None = None, answer: str = "42", finish: str = "stop", **meta) -> Sample:
    ids = text_ids or []
    return Sample([5], ids, [0.0] * len(ids), finish, "v0", metadata={"answer": answer, **meta})


def _score(fn, text: str, answer: str) -> float:
    return fn(_sample(answer=answer), text, {"answer": answer})


def test_registry_and_dotted_paths():
    assert get_reward("exact_match") is rewards.exact_match
    assert get_reward("megatron_rl.rollout.rewards:math_answer") is math_answer
    assert get_reward("megatron_rl.rollout.rewards.math_answer") is math_answer
    assert get_reward("synthetic") is synthetic_task.synthetic_reward  # registered by path: loaded when first asked
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot load reward 'megatron_rl.rollout.rewards:missing'"):
        get_reward("megatron_rl.rollout.rewards:missing")
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("exact_match")(lambda s, t, m: 0.0)


def test_exact_match():
    assert _score(rewards.exact_match, "  42\n", "42") == 1.0
    assert _score(rewards.exact_match, "42.", "42") == 0.0


@pytest.mark.parametrize(
    "text,answer,expected",
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("\\boxed{x^{2}+1} then 7", "x^{2}+1", 1.0),  # nested braces; the box wins over the last number
        ("\\boxed{3} wait, actually \\boxed{4}", "4", 1.0),  # the last box
        ("The answer is 1,000.", "1000", 1.0),
        ("answer: 3/4", "\\frac{3}{4}", 1.0),
        ("we get 12 apples, then 13", "13", 1.0),
        ("we get 12 apples, then 13", "12", 0.0),
        ("\\boxed{0.33334}", "1/3", 0.0),  # numeric, but not within 1e-6 relative
        ("\\boxed{0.3333334}", "1/3", 1.0),
        ("\\boxed{2}", "\\boxed{2}", 1.0),  # a boxed reference is unboxed
        ("no number here", "5", 0.0),
        ("\\boxed{\\text{Paris}}", "paris", 1.0),  # non-numeric: normalised strings
        ("\\boxed{-\\dfrac{2}{3}}", "-2/3", 1.0),
    ],
)
def test_math_answer(text, answer, expected):
    assert _score(math_answer, text, answer) == expected


def test_math_answer_accepts_math_verify_when_installed(monkeypatch):
    assert extract_final_answer("\\boxed{\\sqrt{2}}") == "\\sqrt{2}"
    assert _score(math_answer, "\\boxed{\\sqrt{2}}", "2^{1/2}") == 0.0
    monkeypatch.setattr(math_rewards, "_math_verify", lambda: lambda reference, text: reference == "2^{1/2}")
    assert _score(math_answer, "\\boxed{\\sqrt{2}}", "2^{1/2}") == 1.0


def test_closure_runs_in_threads_errors_and_timeouts_score_zero_and_log_once(tokenizer, caplog):
    """A closure cannot be sent to a worker process: it runs in threads, where a hung call is abandoned."""
    release = threading.Event()
    late = threading.Semaphore(0)  # released by each hung call once it has returned its late result

    def reward(sample: Sample, text: str, metadata) -> float:
        if metadata["kind"] == "raise":
            raise RuntimeError(f"bad sample {text}")
        if metadata["kind"] == "hang":
            try:
                release.wait(60)
                return 1.0  # arrives late: must be ignored
            finally:
                late.release()
        if metadata["kind"] == "nan":
            return float("nan")
        return float(len(text))

    ids = tokenizer("abc", add_special_tokens=False)["input_ids"] + [2]  # "abc" + <|im_end|> (skipped in text)
    kinds = ["ok", "raise", "hang", "ok", "nan", "hang", "raise", "ok"]
    samples = [_sample(ids, kind=k) for k in kinds]
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.rewards"):
        stats = compute_rewards(samples, reward, tokenizer, timeout_s=0.3, max_workers=2)
    # compute_rewards returned while both hung calls were still blocked: it cut them, it did not wait for them.
    assert not late.acquire(blocking=False)
    release.set()
    for _ in range(2):
        assert late.acquire(timeout=60)
    expected = [3.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 3.0]
    assert [s.reward for s in samples] == expected  # the late 1.0s changed nothing
    assert (stats.count, stats.errors, stats.timeouts, stats.mean) == (8, 3, 2, 9.0 / 8)
    assert stats.first_error.startswith("RuntimeError: bad sample abc")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # the note that it runs in threads, and the summary of the failures
    assert "runs in threads" in warnings[0] and "abandoned, not killed" in warnings[0]
    assert "3 of 8 calls raised or returned a non-number and 2 timed out" in warnings[1]
    assert [s.reward_parts for s in samples[:2]] == [{"reward": 3.0}, {"reward": 0.0}]


def test_stats_merge():
    total = rewards.RewardStats(2, 1.0, 1, 0, "E: x") + rewards.RewardStats(2, 2.0, 0, 1, "T")
    assert (total.count, total.mean, total.errors, total.timeouts, total.first_error) == (4, 0.75, 1, 1, "E: x")
