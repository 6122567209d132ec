"""The weight-sync probe: which syncs are checked, the probe's prompts, and the comparison's verdicts."""

from __future__ import annotations

import math

import pytest

from megatron_rl.rollout.engine import ServedScores
from megatron_rl.rollout.sync_probe import (
    TOLERANCES,
    WeightSyncMismatch,
    compare_probe,
    probe_prompts,
    tolerance_for,
    verify_due,
)


def test_verify_due_is_the_first_sync_and_every_nth_after_it() -> None:
    assert [i for i in range(25) if verify_due("every", 10, i)] == [0, 10, 20]
    assert [i for i in range(25) if verify_due("first", 10, i)] == [0]
    assert not any(verify_due("off", 1, i) for i in range(5))


def test_probe_prompts_take_whole_prompts_in_order_and_cut_the_last() -> None:
    prompts = [[1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    assert probe_prompts(prompts, tokens=5) == [[2, 3, 4], [5, 6]]  # a one-token prompt has nothing to score
    assert probe_prompts(prompts, tokens=100) == prompts[1:]
    with pytest.raises(ValueError, match="two or more tokens"):
        probe_prompts([[1], [2]])


def _served(log_probs: list[list[float]], version: str = "step-3", dtype: str = "float32") -> ServedScores:
    return ServedScores("http://h:1", version, dtype, log_probs)


def test_a_probe_within_tolerance_reports_its_error() -> None:
    result = compare_probe([[-1.0, -2.0], [-3.0]], _served([[-1.0, -2.0 + 1e-5], [-3.0 - 2e-5]]), "step-3")
    assert result.tokens == 3 and result.max_abs == pytest.approx(2e-5)
    assert result.mean_abs == pytest.approx(1e-5)


def test_an_error_beyond_the_dtype_tolerance_names_version_error_tolerance_and_causes() -> None:
    tol = TOLERANCES["float32"]
    with pytest.raises(WeightSyncMismatch) as err:
        compare_probe([[-1.0, -2.0]], _served([[-1.0, -2.0 + 10 * tol.max_abs]]), "step-3")
    message = str(err.value)
    assert "weight sync to version 'step-3' did not take effect on http://h:1" in message
    assert f"max |dlogp| = {10 * tol.max_abs:.4g}" in message and "tolerance for float32" in message
    assert "re-lays out" in message and "missed" in message and "TP/EP merge" in message
    # The same error passes under bf16's (looser) tolerance, and NaN never passes.
    compare_probe([[-1.0, -2.0]], _served([[-1.0, -2.0 + 10 * tol.max_abs]], dtype="bfloat16"), "step-3")
    with pytest.raises(WeightSyncMismatch):
        compare_probe([[-1.0]], _served([[math.nan]], dtype="bfloat16"), "step-3")


def test_another_reported_version_or_probe_length_stops() -> None:
    with pytest.raises(WeightSyncMismatch, match="reports version 'step-2' after the sync"):
        compare_probe([[-1.0]], _served([[-1.0]], version="step-2"), "step-3")
    with pytest.raises(WeightSyncMismatch, match="scored 2 probe tokens, the trainer 1"):
        compare_probe([[-1.0]], _served([[-1.0, -1.0]]), "step-3")


def test_an_unknown_dtype_gets_the_loosest_tolerance() -> None:
    assert tolerance_for("auto") == TOLERANCES["bfloat16"] and tolerance_for("torch.float32") == TOLERANCES["float32"]
