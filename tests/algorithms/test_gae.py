"""GAE, VAPO's length-adaptive λ, whitening and the clipped value loss against float64 hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.gae import (
    gae,
    last_token_rewards,
    length_adaptive_lambda,
    masked_whiten,
    mean_and_var,
    moment_sums,
)
from megatron_rl.algorithms.value_loss import clipped_value_loss, explained_variance

F64 = torch.float64


def _by_hand(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """Textbook GAE over the generated positions only (the compressed sequence), as plain Python floats."""
    idx = [t for t, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    running = 0.0
    for k in range(len(idx) - 1, -1, -1):
        t = idx[k]
        nxt = values[idx[k + 1]] if k + 1 < len(idx) else 0.0
        delta = rewards[t] + gamma * nxt - values[t]
        running = delta + gamma * lam * running
        adv[t], ret[t] = running, running + values[t]
    return adv, ret


def test_gae_single_row_by_hand_numbers():
    # 3 generated tokens, reward 1 at the last; gamma 0.9, lambda 0.5.
    values = torch.tensor([[0.0, 0.2, 0.4, 0.6]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=F64)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    d3 = 1.0 - 0.6
    d2 = 0.9 * 0.6 - 0.4
    d1 = 0.9 * 0.4 - 0.2
    a3 = d3
    a2 = d2 + 0.45 * a3
    a1 = d1 + 0.45 * a2
    assert adv[0].tolist() == pytest.approx([0.0, a1, a2, a3], abs=1e-15)
    assert ret[0].tolist() == pytest.approx([0.0, a1 + 0.2, a2 + 0.4, a3 + 0.6], abs=1e-15)


def test_gae_skips_observation_tokens_and_padding():
    """A multi-turn row: generated, observation, generated; the chain crosses the observation with one γ."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 9, generator=g, dtype=F64)
    rewards = torch.randn(3, 9, generator=g, dtype=F64)
    mask = torch.tensor([
        [0, 0, 1, 1, 0, 0, 1, 1, 0],  # prompt, turn 1, observation, turn 2, padding
        [0, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],  # excluded from the loss
    ])  # fmt: skip
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)]:
        adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
        for i in range(3):
            want_a, want_r = _by_hand(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lam)
            assert adv[i].tolist() == pytest.approx(want_a, abs=1e-12)
            assert ret[i].tolist() == pytest.approx(want_r, abs=1e-12)
        assert not adv[mask == 0].any() and not ret[mask == 0].any()


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    """λ = γ = 1: the advantage is the sum of future rewards minus the value (Monte Carlo), VAPO's critic target."""
    values = torch.tensor([[0.5, 0.1, -0.3, 0.2]], dtype=F64)
    mask = torch.ones(1, 4)
    rewards = last_token_rewards(torch.tensor([2.0], dtype=F64), mask)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert ret[0].tolist() == pytest.approx([2.0, 2.0, 2.0, 2.0], abs=1e-15)
    assert adv[0].tolist() == pytest.approx([1.5, 1.9, 2.3, 1.8], abs=1e-15)


def test_gae_per_row_lambda_matches_scalar_runs():
    g = torch.Generator().manual_seed(1)
    values, rewards = torch.randn(2, 6, generator=g, dtype=F64), torch.randn(2, 6, generator=g, dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=torch.tensor([0.3, 0.8], dtype=F64))
    for i, lam in enumerate([0.3, 0.8]):
        one, _ = gae(rewards[i : i + 1], values[i : i + 1], mask[i : i + 1], gamma=0.9, lam=lam)
        assert torch.equal(adv[i], one[0])


def test_last_token_rewards():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    got = last_token_rewards(torch.tensor([1.0, 5.0, -2.0]), mask)
    assert got.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, -2]]


def test_length_adaptive_lambda_vapo_eq7():
    lam = length_adaptive_lambda(torch.tensor([100, 1000, 10]), alpha=0.05)
    assert lam.tolist() == pytest.approx([1 - 1 / 5, 1 - 1 / 50, 0.0], abs=1e-15)  # 1/(0.05*10) = 2 -> floored
    with pytest.raises(ValueError, match="alpha > 0"):
        length_adaptive_lambda(torch.tensor([3]), alpha=0.0)


def test_whitening_matches_verl_masked_whiten():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 1]])
    vals = x[mask.bool()]
    mean, var = mean_and_var(moment_sums(x, mask))
    assert mean == pytest.approx(float(vals.mean()), abs=1e-14)
    assert var == pytest.approx(float(vals.var(unbiased=True)), abs=1e-14)
    w = masked_whiten(x, mask, mean=mean, var=var)
    assert w[mask.bool()].tolist() == pytest.approx(((vals - vals.mean()) / (vals.var() + 1e-8).sqrt()).tolist())
    assert not w[mask == 0].any()
    # Summing the moment sums of two halves (two data-parallel ranks) gives the whole batch's statistics.
    halves = moment_sums(x[:1], mask[:1]) + moment_sums(x[1:], mask[1:])
    assert mean_and_var(halves) == pytest.approx((mean, var), abs=1e-14)


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[0.0, 1.0, 0.5, 3.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, 0.2, 0.4, 0.0]], dtype=F64)
    returns = torch.tensor([[9.0, 0.0, 1.0, 2.5]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, value_clip=0.5)
    # t=1: unclipped (1-0)^2 = 1, clipped v=0.7 -> 0.49: max 1 (unclipped). t=2: 0.25 vs clip(0.5)=0.5 -> 0.25 tie.
    # t=3: unclipped (3-2.5)^2 = 0.25, clipped v=0.5 -> 4.0: max 4.0 (clipped, its gradient is 0).
    assert float(loss) == pytest.approx(0.5 * (1.0 + 0.25 + 4.0), abs=1e-15)
    assert float(metrics["clip_frac_sum"]) == 1.0
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 1.0, -0.5, 0.0], abs=1e-15)
    plain, m = clipped_value_loss(values.detach(), old, returns, mask, value_clip=None)
    assert float(plain) == pytest.approx(0.5 * (1.0 + 0.25 + 0.25), abs=1e-15) and float(m["clip_frac_sum"]) == 0
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        clipped_value_loss(values, old, returns, mask, value_clip=0.0)


def test_explained_variance():
    assert explained_variance(0.25, 1.0) == 0.75
    assert math.isnan(explained_variance(0.5, 0.0))
