"""DAPO reward-side tricks (arXiv 2503.14476): soft overlong punishment, overlong filtering, dynamic sampling."""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.grouping import split_groups
from megatron_rl.algorithms.masking import check_token_tensor


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13 soft overlong punishment, to be *added* to the task reward.

    ``0`` if ``L <= max_len - cache_len``; ``((max_len - cache_len) - L) / cache_len · factor`` up to ``max_len``
    (reaching ``-factor`` at ``L = max_len``); ``-factor`` beyond. ``cache_len = 0`` gives a hard penalty.
    Returns a float tensor shaped like ``response_lengths``.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    if not (factor >= 0 and math.isfinite(factor)):
        raise ValueError(f"factor must be a finite number >= 0, got {factor}")
    lengths = response_lengths.detach()
    lengths = lengths.to(lengths.dtype if lengths.is_floating_point() else torch.float32)
    soft_start = max_len - cache_len
    ramp = (soft_start - lengths) / max(cache_len, 1) * factor
    penalty = torch.where(lengths <= soft_start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_len, torch.full_like(lengths, -factor), penalty)


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: ``response_mask`` with the rows of truncated responses zeroed (same dtype)."""
    check_token_tensor(response_mask, "response_mask")
    if truncated.shape != response_mask.shape[:1]:
        raise ValueError(f"truncated must be [batch] = [{response_mask.shape[0]}], got {tuple(truncated.shape)}")
    keep = ~truncated.bool().unsqueeze(-1)
    return torch.where(keep, response_mask, torch.zeros((), dtype=response_mask.dtype, device=response_mask.device))


def filter_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling (eq. 11): ``True`` for groups to keep, i.e. whose rewards are not all equal.

    ``rewards`` is ``[n_groups * group_size]`` with contiguous groups (pass the metric to filter on, e.g.
    accuracy); a group of all-equal rewards has zero advantage and no gradient. Returns bool ``[n_groups]``.
    """
    groups = split_groups(rewards.detach(), group_size)
    return groups.amax(-1) != groups.amin(-1)
