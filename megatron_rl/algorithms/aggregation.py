"""Reduce a per-token loss matrix to a scalar (verl ``agg_loss`` modes, computed over the local batch).

Notation: ``l[b, t]`` per-token loss, ``m[b, t]`` mask, ``n_b = Σ_t m[b, t]``, ``B`` rows, ``T`` columns,
``S = #{b : n_b > 0}`` (non-empty sequences).

==========================  ==========================================================  ======================
mode                        formula                                                     used by
==========================  ==========================================================  ======================
``token-mean``              ``Σ_bt m·l / Σ_bt m``                                       DAPO eq. 12, CISPO
``seq-mean-token-sum``      ``(1/S) Σ_{b: n_b>0} Σ_t m·l``                              unnormalised per-seq sum
``seq-mean-token-mean``     ``(1/S) Σ_{b: n_b>0} (1/n_b) Σ_t m·l``                      GRPO eq. 3, GSPO, SAPO
``seq-mean-token-sum-norm`` ``Σ_bt m·l / (norm · B)``, ``norm`` defaults to ``T``       Dr. GRPO (Oat, TRL)
==========================  ==========================================================  ======================

``seq-mean-token-sum-norm`` divides by *all* ``B`` rows (empty ones included) so that with a constant ``norm``
(the generation cap ``L_max``) the normaliser is the constant ``B·L_max`` of Dr. GRPO (arXiv 2503.20783, Oat's
``masked_sum(...)/generate_max_length`` then batch mean). verl divides by ``norm · S``, which is the same unless a
row is fully masked.
An all-masked batch gives exactly 0 in every mode. Normalisers are local: combining micro-batches or
data-parallel ranks into a global token/sequence mean is the caller's job.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl.algorithms.masking import bool_mask, check_token_tensor, masked_sum, zero_invalid
from megatron_rl.algorithms.registry import Registry

AggregationFn = Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]
AGGREGATIONS: Registry[AggregationFn] = Registry("aggregation mode")


@AGGREGATIONS.register("token-mean")
def _token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: float | None) -> torch.Tensor:
    return masked_sum(loss, mask) / mask.sum().clamp(min=1).to(loss.dtype)


@AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm: float | None) -> torch.Tensor:
    per_seq = masked_sum(loss, mask, dim=-1)
    return per_seq.sum() / _num_nonempty(mask).to(loss.dtype)


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: float | None) -> torch.Tensor:
    per_seq = masked_sum(loss, mask, dim=-1) / mask.sum(-1).clamp(min=1).to(loss.dtype)
    return per_seq.sum() / _num_nonempty(mask).to(loss.dtype)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: float | None) -> torch.Tensor:
    scale = float(max(loss.shape[-1], 1)) if norm is None else norm
    return masked_sum(loss, mask) / (scale * max(loss.shape[0], 1))


def _num_nonempty(mask: torch.Tensor) -> torch.Tensor:
    return mask.any(-1).sum().clamp(min=1)


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm: float | None = None
) -> torch.Tensor:
    """Aggregate per-token losses ``[batch, response_len]`` into a scalar using ``mode`` (see module docstring).

    ``norm`` is only accepted for ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv 2503.20783 §3: pass the
    constant generation cap ``L_max``); it must be positive. Masked positions may hold NaN/inf.
    """
    fn = AGGREGATIONS.get(mode)
    check_token_tensor(loss_mat, "loss_mat")
    valid = bool_mask(mask, loss_mat, "mask")
    if norm is not None:
        if mode != "seq-mean-token-sum-norm":
            raise ValueError(f"norm only applies to aggregation mode 'seq-mean-token-sum-norm', not {mode!r}")
        if not norm > 0:
            raise ValueError(f"norm must be positive, got {norm}")
    return fn(zero_invalid(loss_mat, valid), valid, norm)
