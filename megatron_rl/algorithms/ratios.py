"""Log-ratio -> importance-ratio conversion that cannot overflow.

Every importance ratio in this package is ``exp(clamp(log_ratio, -20, 20))``, as in verl. ``e^20 ≈ 4.9e8`` is
far outside any clip range, so the clamp changes no trained value; it only keeps values and gradients finite
(the gradient is 0 where the clamp is active).
"""

from __future__ import annotations

import torch

LOG_RATIO_BOUND = 20.0


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))``."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
