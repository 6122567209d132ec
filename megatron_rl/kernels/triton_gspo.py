"""Triton kernel of the packed sequence-level GSPO / GSPO-token loss (semantics: ``kernels.gspo``).

One program per sequence streams its tokens in ``BLOCK`` chunks three times at most:

1. masked sum of ``log pi - log pi_old`` and the valid-token count ``n_i`` -> ``s_i`` (clamped in log space);
2. per-token clipped loss ``w_t max(-A_t s_i, -A_t clip(s_i))`` summed with weight ``1/n_i``, clip counts, and
   ``d loss / d s_i`` (the winning branch's slope; the mean of both on a tie, torch's ``maximum`` rule);
   ``gspo_token`` writes its per-token gradient here;
3. ``gspo`` only: writes ``d loss / d log pi_t = (1/n_i) s_i d loss / d s_i`` on the sequence's valid tokens.

Each program writes its sequence's ``n_i``, ``s_i``, loss share and clip counts; the wrapper divides by the
number of non-empty sequences ``S`` (a reduction over ``n`` numbers) and folds ``1/S`` into the backward's
scale, so the ``[T]`` gradient is written once. Only plain ``tl.*`` operations are used: the same source runs
compiled on a GPU and, with ``TRITON_INTERPRET=1`` set before this module is imported, on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_rl.algorithms.ratios import LOG_RATIO_BOUND

__all__ = ["triton_gspo_forward_and_grad"]

BLOCK = 1024


@triton.jit
def _block(first, offs, end, MASK, HAS_MASK: tl.constexpr):
    """Token indices of the block at ``first``, those inside the sequence, and those that count (the mask)."""
    idx = first + offs
    inside = idx < end
    valid = inside
    if HAS_MASK:
        valid = inside & (tl.load(MASK + idx, mask=inside, other=0) != 0)
    return idx, inside, valid


@triton.jit
def _packed_gspo_kernel(
    LOGP,
    OLD,
    ADV,
    MASK,
    WEIGHTS,
    CU,
    GRAD,
    SEQ_STATS,
    low,
    high,
    bound,
    PER_TOKEN_ADV: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    TOKEN_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    start = tl.load(CU + seq).to(tl.int64)
    end = tl.load(CU + seq + 1).to(tl.int64)
    offs = tl.arange(0, BLOCK)

    # Pass 1: sequence log-ratio.
    sum_log_ratio = 0.0
    n_valid = 0.0
    for first in range(start, end, BLOCK):
        idx, inside, valid = _block(first, offs, end, MASK, HAS_MASK)
        logp = tl.load(LOGP + idx, mask=valid, other=0.0).to(tl.float32)
        old = tl.load(OLD + idx, mask=valid, other=0.0).to(tl.float32)
        sum_log_ratio += tl.sum(tl.where(valid, logp - old, 0.0), axis=0)
        n_valid += tl.sum(valid.to(tl.float32), axis=0)
    count = tl.maximum(n_valid, 1.0)
    seq_log_ratio = sum_log_ratio / count
    clamp_passes = ((seq_log_ratio >= -bound) & (seq_log_ratio <= bound)).to(tl.float32)
    ratio = tl.exp(tl.minimum(tl.maximum(seq_log_ratio, -bound), bound))
    clipped_ratio = tl.minimum(tl.maximum(ratio, low), high)
    in_range = ((ratio >= low) & (ratio <= high)).to(tl.float32)
    below = (ratio < low).to(tl.float32)
    above = (ratio > high).to(tl.float32)
    if not PER_TOKEN_ADV:
        seq_adv = tl.load(ADV + seq).to(tl.float32)

    # Pass 2: loss, clip counts, d loss / d s (and the per-token gradient of gspo_token).
    loss = 0.0
    grad_ratio_sum = 0.0
    clip_low = 0.0
    clip_high = 0.0
    for first in range(start, end, BLOCK):
        idx, inside, valid = _block(first, offs, end, MASK, HAS_MASK)
        if PER_TOKEN_ADV:
            adv = tl.load(ADV + idx, mask=valid, other=0.0).to(tl.float32)
        else:
            adv = tl.where(valid, seq_adv, 0.0)
        weight = tl.where(valid, 1.0 / count, 0.0)
        if HAS_WEIGHTS:
            weight = weight * tl.load(WEIGHTS + idx, mask=valid, other=0.0).to(tl.float32)
        unclipped = -adv * ratio
        clipped = -adv * clipped_ratio
        slope = tl.where(unclipped > clipped, 1.0, tl.where(unclipped < clipped, in_range, 0.5 * (1.0 + in_range)))
        grad_ratio = weight * (-adv) * slope
        loss += tl.sum(weight * tl.maximum(unclipped, clipped), axis=0)
        grad_ratio_sum += tl.sum(grad_ratio, axis=0)
        clip_low += tl.sum(tl.where(valid & (adv < 0), below, 0.0), axis=0)
        clip_high += tl.sum(tl.where(valid & (adv > 0), above, 0.0), axis=0)
        if TOKEN_GRAD:
            tl.store(GRAD + idx, grad_ratio * ratio * clamp_passes, mask=inside)

    # Pass 3 (gspo): the gradient is constant over the sequence's valid tokens.
    if not TOKEN_GRAD:
        grad = grad_ratio_sum * ratio * clamp_passes / count
        for first in range(start, end, BLOCK):
            idx, inside, valid = _block(first, offs, end, MASK, HAS_MASK)
            tl.store(GRAD + idx, tl.where(valid, grad, 0.0), mask=inside)

    out = SEQ_STATS + seq * 5
    tl.store(out, n_valid)
    tl.store(out + 1, ratio)
    tl.store(out + 2, loss)
    tl.store(out + 3, clip_low)
    tl.store(out + 4, clip_high)


def triton_gspo_forward_and_grad(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor | None,
    rollout_weights: Tensor | None,
    clip_low: float,
    clip_high: float,
    token_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, seq_ratio, clip_frac_low, clip_frac_high, grad, grad_scale)``, fp32; arguments already validated.

    ``grad * grad_scale`` is ``d loss / d log_probs`` (``grad_scale = 1/S``, kept apart so the ``[T]`` gradient
    is written once).
    """
    n_seq = cu_seqlens.numel() - 1
    device = log_probs.device
    grad = torch.empty(log_probs.shape, dtype=torch.float32, device=device)
    seq_stats = torch.zeros((n_seq, 5), dtype=torch.float32, device=device)
    mask = None
    if loss_mask is not None:
        mask = loss_mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
    if n_seq:
        dummy = log_probs
        _packed_gspo_kernel[(n_seq,)](
            log_probs.contiguous(), old_log_probs.contiguous(), advantages.contiguous(),
            dummy if mask is None else mask, dummy if rollout_weights is None else rollout_weights.contiguous(),
            cu_seqlens.contiguous(), grad, seq_stats, 1.0 - clip_low, 1.0 + clip_high, LOG_RATIO_BOUND,
            PER_TOKEN_ADV=advantages.numel() == log_probs.numel(), HAS_MASK=mask is not None,
            HAS_WEIGHTS=rollout_weights is not None, TOKEN_GRAD=token_grad, BLOCK=BLOCK,
        )  # fmt: skip
    n_valid, seq_ratio, seq_loss, low_count, high_count = seq_stats.unbind(1)
    num_seqs = (n_valid > 0).sum().clamp(min=1).float()
    valid_tokens = n_valid.sum().clamp(min=1)
    return (
        seq_loss.sum() / num_seqs,
        seq_ratio,
        low_count.sum() / valid_tokens,
        high_count.sum() / valid_tokens,
        grad,
        1.0 / num_seqs,
    )
