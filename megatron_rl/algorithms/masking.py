"""Response masks and masked reductions over ``[batch, response_len]`` token tensors.

Masks are 0/1 indicators (bool or any numeric dtype; a numeric mask is read as ``mask != 0``, it is not a
weight). Invalid positions are replaced with ``torch.where`` rather than multiplied by the mask, so NaN or
inf garbage in padding never reaches a value or a gradient.
"""

from __future__ import annotations

import torch


def bool_mask(mask: torch.Tensor, like: torch.Tensor, name: str = "response_mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor after checking it has the shape of ``like``."""
    if mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def check_token_tensor(x: torch.Tensor, name: str, shape: torch.Size | None = None) -> None:
    """Raise ValueError unless ``x`` is 2-D ``[batch, response_len]`` (and equals ``shape`` when given)."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be [batch, response_len], got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Floating dtype for loss math: the input's if it is float32/float64, else float32."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def zero_invalid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` at valid positions, exactly 0 elsewhere (gradient to invalid positions is 0, never NaN)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid positions (all of them, or along ``dim``)."""
    valid = zero_invalid(x, mask)
    return valid.sum() if dim is None else valid.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions; 0 where there is none."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)
