"""DAPO overlong punishment, overlong filtering and dynamic-sampling group filter."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import filter_groups, overlong_filter_mask, overlong_penalty


def test_overlong_penalty_boundaries():
    max_len, cache = 20, 4  # soft region (16, 20]
    lengths = torch.tensor([0, 15, 16, 17, 18, 20, 21, 1000])
    got = overlong_penalty(lengths, max_len, cache)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    scaled = overlong_penalty(lengths, max_len, cache, factor=0.5)
    assert scaled.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5])


def test_overlong_penalty_paper_values():
    got = overlong_penalty(torch.tensor([16384.0, 18432.0, 20480.0, 20481.0]), 20480, 4096)
    assert got.tolist() == pytest.approx([0.0, -0.5, -1.0, -1.0])


def test_overlong_penalty_zero_cache_is_hard_cutoff():
    got = overlong_penalty(torch.tensor([10, 11]), 10, 0)
    assert got.tolist() == [0.0, -1.0]


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.tensor([1]), 10, 11), "need 0 <= cache_len <= max_len"),
        ((torch.tensor([1]), 10, -1), "need 0 <= cache_len <= max_len"),
        ((torch.tensor([1]), 10, 2, -1.0), "factor must be a finite number >= 0"),
    ],
)
def test_overlong_penalty_errors(args, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(*args)


def test_filter_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3])
    assert filter_groups(rewards, 3).tolist() == [False, True, False, False]
    assert filter_groups(rewards, 1).tolist() == [False] * 12
    assert filter_groups(rewards, 12).tolist() == [True]


def test_filter_groups_errors():
    with pytest.raises(ValueError, match="not divisible by group_size"):
        filter_groups(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        filter_groups(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        filter_groups(torch.zeros(2, 2), 2)


def test_overlong_filter_mask():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    got = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert got.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert got.dtype == mask.dtype
    bool_got = overlong_filter_mask(mask.bool(), torch.tensor([1, 0, 1]))
    assert bool_got.tolist() == [[False] * 3, [True] * 3, [False] * 3]
    with pytest.raises(ValueError, match=r"truncated must be \[batch\]"):
        overlong_filter_mask(mask, torch.tensor([True, False]))
