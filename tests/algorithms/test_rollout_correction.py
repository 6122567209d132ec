"""Rollout-correction weights (TIS / MIS / IcePop at token, sequence and geometric level) against loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import rollout_correction_weights

LEVELS = ("token", "sequence", "geometric")
MODES = ("tis", "mis", "icepop")


def loop_weights(old, rollout, mask, level, mode, cap, low, high):
    out = np.zeros_like(old)
    for b in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[b, t]]
        deltas = {t: old[b, t] - rollout[b, t] for t in valid}
        for t in valid:
            if level == "token":
                log_w = deltas[t]
            elif level == "sequence":
                log_w = sum(deltas.values())
            else:
                log_w = sum(deltas.values()) / len(valid)
            w = math.exp(min(max(log_w, -20.0), 20.0))
            if mode == "tis":
                w = min(w, cap)
            elif mode == "mis":
                w = w if w <= cap else 0.0
            else:
                w = w if low <= w <= high else 0.0
            out[b, t] = w
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_weights_match_loops(level, mode):
    rng = np.random.default_rng(0)
    mask = np.array([[t < n for t in range(6)] for n in (6, 3, 0, 1, 5, 6)])
    old = rng.uniform(-3, -0.1, size=mask.shape)
    rollout = old + rng.normal(scale=0.6, size=mask.shape)
    rollout[5] = old[5] - 0.01  # a sequence that sits inside every band
    kw = dict(cap=1.5, low=0.7, high=1.6)
    got = rollout_correction_weights(
        torch.tensor(old), torch.tensor(rollout), torch.tensor(mask), level=level, mode=mode, **kw
    )
    expected = loop_weights(old, rollout, mask, level, mode, **kw)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=0)
    assert (got.numpy() > 0).any() and ((got.numpy() == 0) & mask).any() == (mode != "tis")


def test_hand_values_default_options():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-math.log(3.0), math.log(2.5), 0.0]], dtype=torch.float64)  # token ratios 3, 0.4, 1
    mask = torch.ones(1, 3)
    tis = rollout_correction_weights(old, rollout, mask)
    assert tis[0].tolist() == pytest.approx([2.0, 0.4, 1.0])
    mis = rollout_correction_weights(old, rollout, mask, mode="mis")
    assert mis[0].tolist() == pytest.approx([0.0, 0.4, 1.0])
    icepop = rollout_correction_weights(old, rollout, mask, mode="icepop")  # band [0.5, 5]
    assert icepop[0].tolist() == pytest.approx([3.0, 0.0, 1.0])
    seq = rollout_correction_weights(old, rollout, mask, level="sequence", mode="mis", cap=2.0)
    assert seq[0].tolist() == pytest.approx([1.2, 1.2, 1.2])  # 3 · 0.4 · 1
    geo = rollout_correction_weights(old, rollout, mask, level="geometric", cap=10.0)
    assert geo[0].tolist() == pytest.approx([1.2 ** (1 / 3)] * 3)


def test_sequence_mis_drops_whole_sequence():
    old = torch.zeros(2, 3, dtype=torch.float64)
    rollout = torch.tensor([[-0.5, -0.5, 0.0], [0.1, 0.0, 0.0]], dtype=torch.float64)  # seq ratios e^1, e^-0.1
    weights = rollout_correction_weights(old, rollout, torch.ones(2, 3), level="sequence", mode="mis", cap=2.0)
    assert weights[0].tolist() == [0.0, 0.0, 0.0]
    assert weights[1].tolist() == pytest.approx([math.exp(-0.1)] * 3)


def test_band_edges_are_inclusive():
    zeros = torch.zeros(1, 2, dtype=torch.float64)  # every weight is exactly 1
    mask = torch.ones(1, 2)
    assert rollout_correction_weights(zeros, zeros, mask, mode="mis", cap=1.0).tolist() == [[1.0, 1.0]]
    assert rollout_correction_weights(zeros, zeros, mask, mode="icepop", low=1.0, high=1.0).tolist() == [[1.0, 1.0]]
    assert rollout_correction_weights(zeros, zeros, mask, mode="tis", cap=0.5).tolist() == [[0.5, 0.5]]


def test_detached_masked_and_finite():
    old = torch.tensor([[0.0, 1e30, float("nan"), -1e4]], requires_grad=True)
    rollout = torch.tensor([[0.0, -1e30, float("inf"), 1e4]])
    mask = torch.tensor([[True, True, False, True]])
    for level in LEVELS:
        for mode in MODES:
            w = rollout_correction_weights(old, rollout, mask, level=level, mode=mode, cap=1e10, high=1e10)
            assert not w.requires_grad
            assert torch.isfinite(w).all()
            assert w[0, 2].item() == 0.0
    token = rollout_correction_weights(old, rollout, mask, mode="tis", cap=1e10)
    assert token[0].tolist() == pytest.approx([1.0, math.exp(20), 0.0, math.exp(-20)], rel=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(level="seq"), r"unknown rollout-correction level 'seq'; valid levels: token, sequence, geometric"),
        (dict(mode="clip"), r"unknown rollout-correction mode 'clip'; valid modes: tis, mis, icepop"),
        (dict(cap=0.0), "cap must be > 0"),
        (dict(mode="icepop", low=2.0, high=1.0), "icepop needs 0 <= low <= high"),
        (dict(mode="icepop", low=-1.0), "icepop needs 0 <= low <= high"),
        (dict(rollout_log_probs=torch.zeros(2, 4)), r"rollout_log_probs has shape \(2, 4\), expected \(2, 3\)"),
        (dict(response_mask=torch.ones(2, 4)), r"response_mask has shape"),
    ],
)
def test_errors(kwargs, match):
    args = dict(old_log_probs=torch.zeros(2, 3), rollout_log_probs=torch.zeros(2, 3), response_mask=torch.ones(2, 3))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rollout_correction_weights(**args)


def test_correction_stats_count_the_truncated_and_masked_tokens_by_hand():
    from megatron_rl.algorithms import correction_stats

    # token ratios exp(delta): 1, e (> cap 2: truncated), e^-1, and a masked position
    old = torch.tensor([[0.0, 1.0, -1.0, 5.0]])
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = rollout_correction_weights(old, rollout, mask, level="token", mode="tis", cap=2.0)
    stats = correction_stats(w, old, rollout, mask, level="token")
    assert float(stats["rollout_is_corrected_frac"]) == pytest.approx(1 / 3)
    assert float(stats["rollout_is_weight_mean"]) == pytest.approx((1.0 + 2.0 + math.exp(-1.0)) / 3)
    w = rollout_correction_weights(old, rollout, mask, level="token", mode="icepop", low=0.5, high=5.0)
    stats = correction_stats(w, old, rollout, mask, level="token")  # e^-1 < 0.5: masked to 0
    assert float(stats["rollout_is_corrected_frac"]) == pytest.approx(1 / 3)
    assert float(stats["rollout_is_weight_mean"]) == pytest.approx((1.0 + math.e) / 3)
