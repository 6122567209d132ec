"""Outcome-reward advantage estimators over groups of responses to the same prompt.

``compute_advantages`` takes one scalar reward per response, ``[n_groups * group_size]`` with each group's
responses contiguous, and returns one advantage per response (broadcast over tokens by ``policy_loss``).
Each estimator is registered in ``ADVANTAGE_ESTIMATORS`` and maps ``[n_groups, group_size]`` rewards to
advantages of the same shape. A group whose rewards are all equal gets advantages of exactly 0, and a
group of size 1 gets 0 (it has no baseline).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch

from megatron_rl.algorithms.grouping import split_groups
from megatron_rl.algorithms.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def group_centered(groups: torch.Tensor) -> torch.Tensor:
    """``r - mean(group)``, exactly 0 for groups whose rewards are all equal (no rounding residue)."""
    constant = groups.amax(-1, keepdim=True) == groups.amin(-1, keepdim=True)
    centered = groups - groups.mean(-1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centered), centered)


def _unbiased_std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected (N-1) std; 0 when there are fewer than two samples."""
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.sum() if dim is None else x.sum(dim, keepdim=True))
    return x.std() if dim is None else x.std(dim, keepdim=True)


def _check_eps(eps: float) -> None:
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(groups: torch.Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage ``(r_i - mean) / (std + eps)`` (DeepSeekMath, arXiv 2402.03300 §4.1).

    ``std`` is the unbiased (N-1) group std, as in verl/slime/TRL; ``norm_by_std=False`` gives Dr. GRPO.
    """
    _check_eps(eps)
    centered = group_centered(groups)
    if not norm_by_std:
        return centered
    return centered / (_unbiased_std(groups, dim=-1) + eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(groups: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantage ``r_i - mean(group)``, no std division (arXiv 2503.20783 §3)."""
    return group_centered(groups)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(groups: torch.Tensor) -> torch.Tensor:
    """RLOO leave-one-out baseline ``r_i - mean_{j≠i} r_j = G/(G-1)·(r_i - mean)``.

    Kool et al. 2019 "Buy 4 REINFORCE samples, get a baseline for free"; Ahmadian et al., arXiv 2402.14740.
    """
    size = groups.shape[-1]
    if size < 2:
        return torch.zeros_like(groups)
    return group_centered(groups) * (size / (size - 1))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(groups: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): subtract the group mean, divide by the batch (N-1) std + eps.

    The batch mean of group-centred rewards is 0 by construction, so it is not subtracted again.
    """
    _check_eps(eps)
    centered = group_centered(groups)
    return centered / (_unbiased_std(centered) + eps)


def compute_advantages(name: str, rewards: torch.Tensor, group_size: int, **options: object) -> torch.Tensor:
    """Per-response advantages ``[n]`` from rewards ``[n]`` in contiguous groups of ``group_size``.

    ``name`` is a registered estimator (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``); ``options`` are
    its keyword arguments (e.g. ``norm_by_std``, ``eps`` for ``grpo``).
    """
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    accepted = _keyword_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"advantage estimator {name!r} got unknown options {unknown}; accepted: {accepted}")
    groups = split_groups(rewards.detach(), group_size)
    groups = groups.to(groups.dtype if groups.dtype in (torch.float32, torch.float64) else torch.float32)
    return estimator(groups, **options).reshape(-1)


def estimator_options(name: str, **settings: object) -> dict[str, object]:
    """The subset of run-wide `settings` (e.g. ``norm_by_std``) that the estimator ``name`` takes."""
    accepted = _keyword_options(name)
    return {k: v for k, v in settings.items() if k in accepted}


def _keyword_options(name: str) -> list[str]:
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    return [p.name for p in inspect.signature(estimator).parameters.values() if p.kind is p.KEYWORD_ONLY]
