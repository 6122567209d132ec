"""Policy-gradient surrogate losses (PPO/GRPO/DAPO clip, dual-clip, GSPO, GSPO-token, SAPO, CISPO).

Each loss is one function registered in ``POLICY_LOSSES``; it maps sanitised ``[batch, response_len]`` inputs to
a per-token loss (``-objective``) plus the masks used for metrics. ``policy_loss`` validates inputs, replaces
masked positions by zeros (``torch.where``, so padding garbage never reaches a value or a gradient), calls the
loss, applies optional rollout-correction weights and aggregates with the caller's ``agg`` mode — for every
loss, including SAPO (verl forces ``seq-mean-token-mean`` for SAPO; the papers' GSPO and SAPO objectives are
``agg="seq-mean-token-mean"``).

Ratios are ``exp(clamp(log_ratio, ±20))`` (``ratios.py``); GSPO clamps the *sequence* mean log-ratio, not
each token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_rl.algorithms.aggregation import AGGREGATIONS, aggregate
from megatron_rl.algorithms.masking import bool_mask, check_token_tensor, compute_dtype, masked_mean, zero_invalid
from megatron_rl.algorithms.ratios import clamped_exp
from megatron_rl.algorithms.registry import Registry


@dataclass(frozen=True)
class PolicyLossConfig:
    """Hyperparameters shared by the surrogate losses; validated on construction."""

    clip_low: float = 0.2  # ε_low: lower clip bound is 1 - clip_low
    clip_high: float = 0.2  # ε_high: upper clip bound is 1 + clip_high (DAPO Clip-Higher: 0.28)
    clip_c: float | None = None  # dual-clip constant c > 1 (ppo only); None disables dual-clip
    tau_pos: float = 1.0  # SAPO gate temperature for positive advantages
    tau_neg: float = 1.05  # SAPO gate temperature for non-positive advantages

    def __post_init__(self) -> None:
        for field in ("clip_low", "clip_high"):
            value = getattr(self, field)
            if math.isnan(value) or value < 0:
                raise ValueError(f"{field} must be >= 0, got {value}")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ValueError(f"clip_c (dual-clip constant) must be > 1, got {self.clip_c}")
        for field in ("tau_pos", "tau_neg"):
            value = getattr(self, field)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{field} must be a positive finite number, got {value}")


class TokenLoss(NamedTuple):
    """Output of a registered loss: per-token loss and what is needed for its metrics (all ``[B, T]``)."""

    loss: torch.Tensor  # per-token loss to minimise (= -objective)
    ratio: torch.Tensor  # importance ratio the loss used (token ratio, or sequence ratio broadcast)
    clipped_low: torch.Tensor  # bool: lower clip bound active
    clipped_high: torch.Tensor  # bool: upper clip bound active
    clipped_dual: torch.Tensor | None = None  # bool: dual-clip active; None = loss does not support dual-clip


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossConfig], TokenLoss]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig) -> TokenLoss:
    """``max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))``, i.e. ``-min(r·A, clip(r)·A)`` (PPO, arXiv 1707.06347 eq. 7)."""
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = torch.maximum(-adv * ratio, -adv * clipped)
    return TokenLoss(
        loss=loss,
        ratio=ratio,
        clipped_low=(adv < 0) & (ratio < 1 - cfg.clip_low),
        clipped_high=(adv > 0) & (ratio > 1 + cfg.clip_high),
    )


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> TokenLoss:
    """Token-level clipped surrogate of GRPO (arXiv 2402.03300 eq. 3) / DAPO (arXiv 2503.14476 eq. 8, 10).

    With ``cfg.clip_c`` set, dual-clip PPO (Ye et al., arXiv 1912.09729): for ``A < 0`` the loss is further
    capped at ``-c·A``, which bounds the update when ``r → ∞``.
    """
    terms = _clipped_surrogate(clamped_exp(log_probs - old_log_probs), adv, cfg)
    if cfg.clip_c is None:
        return terms._replace(clipped_dual=torch.zeros_like(mask))
    negative = adv < 0
    loss = torch.where(negative, torch.minimum(terms.loss, -adv * cfg.clip_c), terms.loss)
    # For A < 0 the dual cap binds iff max(r, 1-ε_low) > c, i.e. iff r > c (c > 1).
    return terms._replace(loss=loss, clipped_dual=negative & (terms.ratio > cfg.clip_c))


def _sequence_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log s_i = (1/|y_i|) Σ_t (log π_θ - log π_θold)`` as ``[B, 1]`` (GSPO, arXiv 2507.18071 eq. 7)."""
    return masked_mean(log_probs - old_log_probs, mask, dim=-1).unsqueeze(-1)


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> TokenLoss:
    """GSPO (arXiv 2507.18071 eq. 5-7): clip the sequence ratio ``s_i = exp(mean_t log r_it)``.

    Every token of sequence ``i`` carries ``max(-A·s_i, -A·clip(s_i))``; with ``seq-mean-token-mean`` and a
    per-sequence advantage this is exactly eq. 5. ``log s_i`` is clamped to [-20, 20] before ``exp``. The
    gradient reaches the tokens only through ``s_i``, so every valid token of a sequence gets the same gradient:
    per-token advantages and rollout weights are pooled over the sequence (with a per-sequence advantage, a token
    weight acts through the sequence's mean weight). ``gspo_token`` routes them per token instead.
    """
    seq_ratio = clamped_exp(_sequence_log_ratio(log_probs, old_log_probs, mask))
    return _clipped_surrogate(seq_ratio.expand_as(log_probs), adv, cfg)


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> TokenLoss:
    """GSPO-token (arXiv 2507.18071 eq. 13-17): ``log s_it = sg(log s_i) + log π_t - sg(log π_t)``.

    Numerically ``s_it = s_i``; the gradient of token ``t`` is ``s_i·A_it·∇log π_t``, so per-token advantages
    are allowed. Equals ``gspo`` (value and gradient) when the advantage is constant over each sequence.
    """
    seq_log_ratio = _sequence_log_ratio(log_probs, old_log_probs, mask).detach()
    token_log_ratio = seq_log_ratio + log_probs - log_probs.detach()
    return _clipped_surrogate(clamped_exp(token_log_ratio), adv, cfg)


@POLICY_LOSSES.register("sapo")
def sapo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> TokenLoss:
    """SAPO (arXiv 2511.20347): soft gate ``f(r) = σ(τ(r-1))·4/τ`` instead of a hard clip; loss ``-f(r)·A``.

    ``τ = τ_pos`` if ``A > 0`` else ``τ_neg``. ``f(1) = 2/τ`` and ``f'(1) = 1``, so at ``r = 1`` the gradient is the
    plain policy gradient; it decays smoothly (faster for larger τ) as ``r`` leaves 1. Nothing is clipped.
    """
    ratio = clamped_exp(log_probs - old_log_probs)
    tau = torch.where(adv > 0, ratio.new_tensor(cfg.tau_pos), ratio.new_tensor(cfg.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    never = torch.zeros_like(mask)
    return TokenLoss(loss=-gate * adv, ratio=ratio, clipped_low=never, clipped_high=never)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> TokenLoss:
    """CISPO (MiniMax-M1, arXiv 2506.13585 eq. 4-5): ``-sg(clip(r, 1-ε_low, 1+ε_high))·A·log π_θ``.

    The IS weight is clipped and detached, so every token keeps the gradient ``-clip(r)·A``. The paper uses no
    lower bound (``clip_low >= 1``) and tunes only ``clip_high``; the defaults 0.2/0.2 give weights in [0.8, 1.2].
    Clip fractions count tokens whose weight was clipped, whatever the sign of ``A``.
    """
    ratio = clamped_exp(log_probs - old_log_probs)
    weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high).detach()
    return TokenLoss(
        loss=-weight * adv * log_probs,
        ratio=ratio,
        clipped_low=ratio < 1 - cfg.clip_low,
        clipped_high=ratio > 1 + cfg.clip_high,
    )


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.shape == like.shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(-1).expand_as(like)
    raise ValueError(
        f"advantages must be [batch] or [batch, response_len] = {tuple(like.shape)}, got {tuple(advantages.shape)}"
    )


def _metrics(terms: TokenLoss, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Detached 0-dim metrics over valid tokens; an all-masked batch gives 0 (and 1 for the ratio stats)."""
    with torch.no_grad():
        dtype = log_ratio.dtype
        ratio = terms.ratio.detach()
        dual = terms.clipped_dual if terms.clipped_dual is not None else torch.zeros_like(mask)
        any_valid = mask.any()
        one = torch.ones((), dtype=dtype, device=ratio.device)
        return {
            "clip_frac_low": masked_mean(terms.clipped_low.to(dtype), mask),
            "clip_frac_high": masked_mean(terms.clipped_high.to(dtype), mask),
            "clip_frac_dual": masked_mean(dual.to(dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": torch.where(any_valid, masked_mean(ratio, mask), one),
            "ratio_max": torch.where(any_valid, torch.where(mask, ratio, -torch.inf).amax(), one),
            "ratio_min": torch.where(any_valid, torch.where(mask, ratio, torch.inf).amin(), one),
        }


def policy_loss(
    name: str,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg_norm: float | None = None,
    rollout_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated policy loss (to minimise, ``= -J``) of the registered loss ``name`` and its metrics.

    Tensors are ``[batch, response_len]``; ``advantages`` may also be ``[batch]``. ``old_log_probs``,
    ``advantages`` and ``rollout_weights`` are treated as constants. ``rollout_weights`` (e.g. from
    ``rollout_correction_weights``; TIS/MIS/IcePop) multiply the per-token loss after clipping. ``agg`` and
    ``agg_norm`` are passed to ``aggregate``. Metrics (0-dim, detached): ``clip_frac_low``, ``clip_frac_high``,
    ``clip_frac_dual`` (fractions of valid tokens), ``ppo_kl`` (mean of ``old - new`` log-prob),
    ``ratio_mean/max/min``.
    """
    loss_fn = POLICY_LOSSES.get(name)
    AGGREGATIONS.get(agg)  # fail on an unknown mode before any computation
    cfg = PolicyLossConfig(clip_low, clip_high, clip_c, tau_pos, tau_neg)
    check_token_tensor(log_probs, "log_probs")
    check_token_tensor(old_log_probs, "old_log_probs", log_probs.shape)
    mask = bool_mask(response_mask, log_probs)
    dtype = compute_dtype(log_probs)

    logp = zero_invalid(log_probs.to(dtype), mask)
    old_logp = zero_invalid(old_log_probs.detach().to(dtype), mask)
    adv = zero_invalid(_broadcast_advantages(advantages.detach().to(dtype), log_probs), mask)

    terms = loss_fn(logp, old_logp, adv, mask, cfg)
    if cfg.clip_c is not None and terms.clipped_dual is None:
        raise ValueError(f"clip_c (dual-clip) is not supported by policy loss {name!r}")
    loss_mat = terms.loss
    if rollout_weights is not None:
        check_token_tensor(rollout_weights, "rollout_weights", log_probs.shape)
        loss_mat = loss_mat * zero_invalid(rollout_weights.detach().to(dtype), mask)

    loss = aggregate(loss_mat, mask, agg, agg_norm)
    return loss, _metrics(terms, (logp - old_logp).detach(), mask)
