"""The critic's loss: PPO's clipped value loss, and the critic's fit metrics.

``L_V = ½ · mean_t max((V_t − R_t)², (clip(V_t, V_t^old − ε_v, V_t^old + ε_v) − R_t)²)`` over valid tokens
(token-mean; the clipped form of Schulman et al.'s PPO implementation, verl's ``compute_value_loss``), with
``ε_v = value_clip`` (None: the plain squared error).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.masking import bool_mask, check_token_tensor, masked_sum


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    value_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, metrics)``: the per-token ``½ max(...)`` summed over valid tokens (divide by their count for
    the token mean: the caller's global normaliser), and ``clip_frac`` (the share of valid tokens whose clipped
    error is the larger; 0 without clipping) as a sum over valid tokens as well."""
    check_token_tensor(values, "values")
    check_token_tensor(old_values, "old_values", values.shape)
    check_token_tensor(returns, "returns", values.shape)
    valid = bool_mask(mask, values, "mask")
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token, clipped_more = unclipped, torch.zeros_like(valid)
    else:
        if not value_clip > 0:
            raise ValueError(f"value_clip must be > 0 (or None for no clipping), got {value_clip}")
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (clipped - returns) ** 2
        per_token, clipped_more = torch.maximum(unclipped, clipped_error), clipped_error > unclipped
    loss_sum = 0.5 * masked_sum(per_token, valid)
    return loss_sum, {"clip_frac_sum": masked_sum(clipped_more.to(values.dtype), valid).detach()}


def explained_variance(residual_var: float, returns_var: float) -> float:
    """``1 − Var(R − V) / Var(R)`` from the two variances over valid tokens (`gae.mean_and_var`): 1 for a perfect
    critic, 0 for one no better than the mean return, NaN when the returns are constant."""
    return float("nan") if returns_var == 0 else 1.0 - residual_var / returns_var
