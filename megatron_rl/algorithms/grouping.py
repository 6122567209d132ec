"""Reshape per-response values into prompt groups (``G`` responses per prompt, stored contiguously)."""

from __future__ import annotations

import torch


def split_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[n_groups * group_size]`` -> ``[n_groups, group_size]``, raising ValueError on a bad shape or size."""
    if values.dim() != 1:
        raise ValueError(f"rewards must be 1-D [n_groups * group_size], got shape {tuple(values.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if values.numel() % group_size:
        raise ValueError(f"number of rewards {values.numel()} is not divisible by group_size {group_size}")
    return values.reshape(-1, group_size)
