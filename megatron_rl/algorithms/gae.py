"""Value-based advantages: per-token rewards, generalised advantage estimation over the generated tokens,
VAPO's length-adaptive λ, and advantage whitening (verl's ``masked_whiten``).

Tensors are ``[batch, seq]`` and aligned like the actor's fields: position t is token t, ``values[:, t]`` is the
critic's value of the state before token t (its output at position t - 1), and ``mask`` is 1 at the generated
tokens that train. Positions with mask 0 are skipped, not cut: a multi-turn sample's observation tokens carry
neither rewards nor values, and γ and λ apply once per generated token, so the chain runs from one generated
token to the next generated token across an observation (as verl's ``compute_gae_advantage_return``).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.masking import bool_mask, check_token_tensor

ADVANTAGE = "gae"  # `algo.advantage` name of the critic's estimator (the group estimators are ADVANTAGE_ESTIMATORS)


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` rewards: each row's outcome score at its last generated token (mask 1), 0 elsewhere; a row
    with no generated token gets none."""
    valid = mask != 0
    seq = valid.shape[1]
    last = seq - 1 - valid.flip(-1).int().argmax(-1)
    rewards = torch.zeros(valid.shape, dtype=scores.dtype)
    has = valid.any(-1)
    rewards[has.nonzero().squeeze(-1), last[has]] = scores[has]
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` by GAE (Schulman et al., arXiv 1506.02438, eq. 16) over each row's generated tokens
    t_1 < ... < t_L: ``δ_k = r_{t_k} + γ V_{t_{k+1}} − V_{t_k}`` (``V_{t_{L+1}} = 0``), ``A_k = δ_k + γ λ A_{k+1}``,
    ``R_k = A_k + V_{t_k}``. ``lam``: a number, or one per row (``[batch]``, VAPO's length-adaptive λ). Both outputs
    are 0 where mask is 0. Computed in float64 or the inputs' float dtype, whichever is wider."""
    check_token_tensor(values, "values")
    check_token_tensor(rewards, "rewards", values.shape)
    valid = bool_mask(mask, values, "mask")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    r, v = rewards.to(dtype), values.to(dtype)
    lam_rows = torch.as_tensor(lam, dtype=dtype).expand(values.shape[0])
    advantages = torch.zeros_like(v)
    next_value = torch.zeros(v.shape[0], dtype=dtype)
    running = torch.zeros(v.shape[0], dtype=dtype)
    for t in range(v.shape[1] - 1, -1, -1):
        here = valid[:, t]
        step = r[:, t] + gamma * next_value - v[:, t] + gamma * lam_rows * running
        running = torch.where(here, step, running)
        next_value = torch.where(here, v[:, t], next_value)
        advantages[:, t] = torch.where(here, running, 0.0)
    returns = torch.where(valid, advantages + v, 0.0)
    return advantages, returns


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's policy λ per row (Yue et al., arXiv 2504.05118, eq. 7): ``λ = 1 − 1/(α·l)`` for a response of ``l``
    generated tokens, so that the sum of the GAE weights, 1/(1−λ), is proportional to the length; floored at 0."""
    if not alpha > 0:
        raise ValueError(f"the length-adaptive λ needs alpha > 0, got {alpha}")
    return (1.0 - 1.0 / (alpha * lengths.to(torch.float64).clamp(min=1))).clamp(min=0.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, mean: float, var: float) -> torch.Tensor:
    """verl's ``masked_whiten`` with the statistics given (the batch's, summed over data-parallel ranks by the
    caller): ``(x − mean) / sqrt(var + 1e-8)`` at valid positions, 0 elsewhere; ``var`` is the unbiased variance."""
    valid = bool_mask(mask, values, "mask")
    return torch.where(valid, (values - mean) * (var + 1e-8) ** -0.5, 0.0)


def moment_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, Σx, Σx²]`` over valid positions (float64), to be summed over ranks and read by `mean_and_var`."""
    valid = bool_mask(mask, values, "mask")
    x = values[valid].to(torch.float64)
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), (x * x).sum()])


def mean_and_var(sums: torch.Tensor) -> tuple[float, float]:
    """The mean and the unbiased variance from `moment_sums` (0 variance with fewer than two values)."""
    count, total, squares = sums.tolist()
    if count == 0:
        return 0.0, 0.0
    mean = total / count
    var = (squares - count * mean * mean) / (count - 1) if count > 1 else 0.0
    return mean, max(var, 0.0)
