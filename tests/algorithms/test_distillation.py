"""On-policy distillation's advantages (`algorithms/distillation.py`, eq. 1-2) against float64 hand computation."""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.distillation import mixed_advantages, reverse_kl_advantages, sequence_mean

# two samples, four positions: sample 0 trains positions 1-3, sample 1 positions 2-3 (a prompt before them)
TEACHER = torch.tensor([[0.0, -0.5, -2.0, -0.1], [0.0, 0.0, -1.5, -3.0]], dtype=torch.float64)
OLD = torch.tensor([[0.0, -1.0, -1.0, -0.1], [0.0, -9.0, -0.5, -2.0]], dtype=torch.float64)
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)


def test_reverse_kl_advantage_is_teacher_minus_old_policy_on_trained_tokens() -> None:
    got = reverse_kl_advantages(TEACHER, OLD, MASK)
    # log pi_T - log pi_old by hand: 0.5, -1.0, 0.0 | -1.0, -1.0; prompt positions 0 (even where they differ)
    assert got.tolist() == [[0.0, 0.5, -1.0, 0.0], [0.0, 0.0, -1.0, -1.0]]
    # its mean over trained tokens is minus the sampled estimate of KL(pi_old || pi_T)
    kl = sum(o - t for o, t, m in zip(OLD.flatten(), TEACHER.flatten(), MASK.flatten(), strict=True) if m)
    assert math.isclose(-float(got.sum()) / float(MASK.sum()), float(kl) / 5, rel_tol=0, abs_tol=1e-15)


def test_mixed_advantage_adds_coef_times_distillation_to_the_task_advantage() -> None:
    task = torch.tensor([0.7, -0.7], dtype=torch.float64)
    distill = reverse_kl_advantages(TEACHER, OLD, MASK)
    got = mixed_advantages(task, distill, MASK, coef=0.5)
    expected = [[0.0, 0.7 + 0.25, 0.7 - 0.5, 0.7], [0.0, 0.0, -0.7 - 0.5, -0.7 - 0.5]]
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)
    alone = mixed_advantages(task, distill, MASK, coef=2.0, task_rewards=False)
    assert alone.tolist() == [[0.0, 1.0, -2.0, 0.0], [0.0, 0.0, -2.0, -2.0]]


def test_a_sequence_level_loss_takes_the_token_mean_of_a_samples_advantages() -> None:
    adv = torch.tensor([[9.0, 0.5, -1.0, 0.0], [9.0, 9.0, -1.0, -2.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.float64)])
    got = sequence_mean(adv, mask)
    assert torch.allclose(got[0], torch.full((4,), -0.5 / 3, dtype=torch.float64), rtol=0, atol=1e-15)
    assert got[1].tolist() == [-1.5] * 4
    assert got[2].tolist() == [0.0] * 4  # nothing trained in that row
    constant = torch.full((1, 7), 0.1 + 0.2, dtype=torch.float32)  # here a plain mean, sum / 7, is not x
    assert torch.equal(sequence_mean(constant, torch.ones(1, 7)), constant)
