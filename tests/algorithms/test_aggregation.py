"""Loss aggregation modes against explicit loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import AGGREGATIONS, aggregate

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loop_aggregate(loss, mask, mode, norm=None):
    B, L = len(loss), len(loss[0])
    rows = [[loss[b][t] for t in range(L) if mask[b][t]] for b in range(B)]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(map(sum, rows)) / max(sum(map(len, rows)), 1)
    if mode == "seq-mean-token-sum":
        return sum(map(sum, nonempty)) / max(len(nonempty), 1)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / max(len(nonempty), 1)
    return sum(map(sum, rows)) / ((L if norm is None else norm) * B)


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    loss = rng.normal(size=(4, 7))
    mask = np.array([[t < n for t in range(7)] for n in (7, 3, 0, 5)])
    return loss, mask


@pytest.mark.parametrize("mode", MODES)
def test_modes_match_loops(batch, mode):
    loss, mask = batch
    got = aggregate(torch.tensor(loss), torch.tensor(mask), mode)
    assert got.item() == pytest.approx(loop_aggregate(loss.tolist(), mask.tolist(), mode), rel=1e-12)


def test_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (3 * 3))
    # Dr. GRPO (Oat / TRL): constant normaliser B · L_max.
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm=100).item() == pytest.approx(10 / (3 * 100))


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_is_zero_not_nan(mode):
    loss = torch.full((3, 5), float("nan"), requires_grad=True)
    got = aggregate(loss, torch.zeros(3, 5, dtype=torch.bool), mode)
    got.backward()
    assert got.item() == 0.0
    assert (loss.grad == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_garbage_at_masked_positions_is_ignored(batch, mode):
    loss, mask = batch
    clean = aggregate(torch.tensor(loss), torch.tensor(mask), mode)
    for garbage in (float("nan"), float("inf"), 1e30):
        dirty = torch.where(torch.tensor(mask), torch.tensor(loss), garbage)
        assert torch.equal(aggregate(dirty, torch.tensor(mask).float(), mode), clean)


def test_gradient_weights(batch):
    loss, mask = batch
    lt = torch.tensor(loss, requires_grad=True)
    aggregate(lt, torch.tensor(mask), "seq-mean-token-mean").backward()
    lengths = mask.sum(1)
    expected = np.where(mask, 1.0 / np.maximum(lengths, 1)[:, None] / (lengths > 0).sum(), 0.0)
    np.testing.assert_allclose(lt.grad.numpy(), expected, rtol=1e-12)


def test_registry_names():
    assert set(AGGREGATIONS.names()) == set(MODES)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="sum"), r"unknown aggregation mode 'sum'; valid names: seq-mean-token-mean"),
        (dict(mode="token-mean", norm=3.0), "norm only applies"),
        (dict(mode="seq-mean-token-sum-norm", norm=-1.0), "norm must be positive"),
        (dict(mode="token-mean", mask=torch.ones(2, 4)), r"mask has shape \(2, 4\), expected \(2, 3\)"),
        (
            dict(mode="token-mean", loss_mat=torch.ones(6), mask=torch.ones(6)),
            r"loss_mat must be \[batch, response_len\]",
        ),
    ],
)
def test_errors(kwargs, match):
    args = dict(loss_mat=torch.ones(2, 3), mask=torch.ones(2, 3))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        aggregate(**args)
