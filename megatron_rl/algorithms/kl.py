"""Per-token KL(π_θ ‖ π_ref) estimators (Schulman, "Approximating KL Divergence", 2020).

With samples from π_θ and ``d = log π_ref - log π_θ`` (``log r`` in Schulman's notation):

* ``k1 = -d = log π_θ - log π_ref``: unbiased, high variance, can be negative.
* ``k2 = ½ d²``: biased, low variance, ``≥ 0``; its gradient is the reverse-KL gradient.
* ``k3 = e^d - d - 1``: unbiased, low variance, ``≥ 0`` (GRPO eq. 4). ``d`` is clamped to [-20, 20] first.
* ``low_var_kl``: ``k3`` with the result clamped to [-10, 10], as verl's ``low_var_kl``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl.algorithms.masking import bool_mask, zero_invalid
from megatron_rl.algorithms.ratios import LOG_RATIO_BOUND
from megatron_rl.algorithms.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")

LOW_VAR_KL_BOUND = 10.0


@KL_ESTIMATORS.register("k1")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman k1: ``log π_θ - log π_ref``."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("k2")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman k2: ``½ (log π_θ - log π_ref)²``."""
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman k3 / GRPO eq. 4 (arXiv 2402.03300): ``e^d - d - 1``, ``d = clamp(log π_ref - log π_θ, ±20)``."""
    d = (ref_log_probs - log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(d) - d - 1


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """verl ``low_var_kl``: k3 clamped to [-10, 10]."""
    return kl_k3(log_probs, ref_log_probs).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate of kind ``k1``/``k2``/``k3``/``low_var_kl`` (same shape as the inputs).

    ``ref_log_probs`` is a constant. With ``response_mask``, masked positions are exactly 0 and their
    (possibly NaN) inputs cannot reach the gradient; aggregate with ``aggregate`` as for the policy loss.
    """
    estimator = KL_ESTIMATORS.get(kind)
    if ref_log_probs.shape != log_probs.shape:
        raise ValueError(f"ref_log_probs has shape {tuple(ref_log_probs.shape)}, expected {tuple(log_probs.shape)}")
    ref_log_probs = ref_log_probs.detach()
    if response_mask is None:
        return estimator(log_probs, ref_log_probs)
    mask = bool_mask(response_mask, log_probs)
    kl = estimator(zero_invalid(log_probs, mask), zero_invalid(ref_log_probs, mask))
    return zero_invalid(kl, mask)
