"""Importance weights correcting for the rollout engine / training engine mismatch (TIS, MIS, IcePop).

The ratio is ``π_train(θ_old) / π_rollout(θ_old) = exp(old_log_probs - rollout_log_probs)``, at one of three
levels:

* ``token``: ``w_t = exp(Δ_t)`` (TIS blog, Yao et al. 2025; IcePop, arXiv 2510.18855);
* ``sequence``: ``w = exp(Σ_t Δ_t)``, the product of token ratios, broadcast over the sequence (the unbiased
  sequence-level IS of the MIS blog, Liu et al. 2025; verl and TRL);
* ``geometric``: ``w = exp(mean_t Δ_t)``, the length-normalised geometric mean (ms-swift's "sequence").

and one of three modes: ``tis`` truncates ``min(w, cap)``; ``mis`` masks ``w·𝟙[w ≤ cap]``; ``icepop`` masks
outside ``[low, high]``. The exponent is clamped to [-20, 20]. Weights are detached and 0 at masked positions;
pass them as ``policy_loss(..., rollout_weights=w)``, which multiplies the per-token loss after clipping.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.masking import bool_mask, check_token_tensor, masked_mean, masked_sum, zero_invalid
from megatron_rl.algorithms.ratios import clamped_exp

LEVELS = ("token", "sequence", "geometric")
MODES = ("tis", "mis", "icepop")


def _log_weight(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return log_ratio
    if level == "sequence":
        return masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    return masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)


def _check_options(level: str, mode: str, cap: float, low: float, high: float) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown rollout-correction level {level!r}; valid levels: {', '.join(LEVELS)}")
    if mode not in MODES:
        raise ValueError(f"unknown rollout-correction mode {mode!r}; valid modes: {', '.join(MODES)}")
    if mode in ("tis", "mis") and not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if mode == "icepop" and not (0 <= low <= high and not math.isnan(high)):
        raise ValueError(f"icepop needs 0 <= low <= high, got low={low}, high={high}")


def rollout_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 5.0,
) -> torch.Tensor:
    """Detached ``[batch, response_len]`` rollout-correction weights; 0 at masked positions.

    ``tis``: ``min(w, cap)`` (TIS, C = 2). ``mis``: ``w`` if ``w <= cap`` else 0 (MIS; at ``sequence`` level the
    whole sequence is dropped). ``icepop``: ``w`` if ``low <= w <= high`` else 0 (IcePop, arXiv 2510.18855
    §IcePop, α = 0.5, β = 5).
    """
    _check_options(level, mode, cap, low, high)
    check_token_tensor(old_log_probs, "old_log_probs")
    check_token_tensor(rollout_log_probs, "rollout_log_probs", old_log_probs.shape)
    mask = bool_mask(response_mask, old_log_probs)
    with torch.no_grad():
        log_ratio = zero_invalid(old_log_probs, mask) - zero_invalid(rollout_log_probs, mask)
        weight = clamped_exp(_log_weight(log_ratio, mask, level))
        if mode == "tis":
            weight = weight.clamp(max=cap)
        elif mode == "mis":
            weight = torch.where(weight <= cap, weight, 0.0)
        else:
            weight = torch.where((weight >= low) & (weight <= high), weight, 0.0)
        return zero_invalid(weight, mask)


def correction_stats(
    weights: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
) -> dict[str, torch.Tensor]:
    """Of `rollout_correction_weights`' output over the valid tokens: the mean weight, and the fraction the mode
    changed (truncated to the cap, or masked to 0) from the raw ratio at `level`."""
    mask = bool_mask(response_mask, old_log_probs)
    with torch.no_grad():
        log_ratio = zero_invalid(old_log_probs, mask) - zero_invalid(rollout_log_probs, mask)
        raw = clamped_exp(_log_weight(log_ratio, mask, level))
        return {
            "rollout_is_weight_mean": masked_mean(weights, mask),
            "rollout_is_corrected_frac": masked_mean((weights != raw).float(), mask),
        }
