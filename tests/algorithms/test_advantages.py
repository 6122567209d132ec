"""Group advantage estimators against numpy / explicit definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.25, 0.75, 2.0, 3.0, -1.0, 0.0, 4.0]


def test_registry_names():
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}


def test_grpo_matches_unbiased_std():
    r = np.array(REWARDS).reshape(3, 4)
    expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    got = compute_advantages("grpo", torch.tensor(REWARDS, dtype=torch.float64), 4)
    np.testing.assert_allclose(got.numpy(), expected.reshape(-1), rtol=1e-12)


def test_grpo_options():
    r = np.array(REWARDS).reshape(3, 4)
    got = compute_advantages("grpo", torch.tensor(REWARDS, dtype=torch.float64), 4, eps=0.5)
    expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 0.5)
    np.testing.assert_allclose(got.numpy(), expected.reshape(-1), rtol=1e-12)
    centered = compute_advantages("grpo", torch.tensor(REWARDS, dtype=torch.float64), 4, norm_by_std=False)
    np.testing.assert_allclose(centered.numpy(), (r - r.mean(1, keepdims=True)).reshape(-1), rtol=1e-12)
    dr = compute_advantages("dr_grpo", torch.tensor(REWARDS, dtype=torch.float64), 4)
    assert torch.equal(centered, dr)


def test_rloo_leave_one_out():
    r = REWARDS
    expected = []
    for g in range(3):
        group = r[4 * g : 4 * g + 4]
        for i in range(4):
            others = [group[j] for j in range(4) if j != i]
            expected.append(group[i] - sum(others) / 3)
    got = compute_advantages("rloo", torch.tensor(r, dtype=torch.float64), 4)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-15)


def test_reinforce_pp_batch_std():
    r = np.array(REWARDS).reshape(3, 4)
    centered = (r - r.mean(1, keepdims=True)).reshape(-1)
    expected = centered / (centered.std(ddof=1) + 1e-6)
    got = compute_advantages("reinforce_pp", torch.tensor(REWARDS, dtype=torch.float64), 4)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("value", [0.1, 0.3, 1.0, -7.3, 1e-9])
def test_all_equal_group_gives_exact_zeros(name, value):
    # In float32, 0.1 - mean([0.1] * 7) = -7.45e-9: without special care, /(0 + 1e-6) turns it into -0.0075.
    rewards = torch.tensor([value] * 7 + [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float32)
    adv = compute_advantages(name, rewards, 7)
    assert torch.isfinite(adv).all()
    assert (adv[:7] == 0).all()
    assert (adv[7:] != 0).all()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_group_size_one_gives_zero(name):
    adv = compute_advantages(name, torch.tensor([1.0, 0.0, 3.0]), 1)
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_integer_and_bool_rewards_are_promoted():
    adv = compute_advantages("grpo", torch.tensor([1, 0, 0, 1]), 2)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([0.7071061, -0.7071061, -0.7071061, 0.7071061], rel=1e-5)
    assert compute_advantages("dr_grpo", torch.tensor([True, False]), 2).tolist() == [0.5, -0.5]


@pytest.mark.parametrize(
    "args,options,match",
    [
        (("ppo", torch.zeros(4), 2), {}, r"unknown advantage estimator 'ppo'; valid names: dr_grpo, grpo"),
        (("grpo", torch.zeros(5), 2), {}, "number of rewards 5 is not divisible by group_size 2"),
        (("grpo", torch.zeros(4), 0), {}, "group_size must be a positive int"),
        (("grpo", torch.zeros(4), 2.0), {}, "group_size must be a positive int"),
        (("grpo", torch.zeros(2, 2), 2), {}, r"rewards must be 1-D"),
        (
            ("grpo", torch.zeros(4), 2),
            {"norm_by_sd": False},
            r"unknown options \['norm_by_sd'\]; accepted: \['norm_by_std', 'eps'\]",
        ),
        (("rloo", torch.zeros(4), 2), {"eps": 1e-6}, r"unknown options \['eps'\]"),
        (("grpo", torch.zeros(4), 2), {"eps": -1.0}, "eps must be a finite number >= 0"),
    ],
)
def test_errors(args, options, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(*args, **options)
