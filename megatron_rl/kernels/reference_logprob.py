"""Per-token log-probs and entropy from vocab-sharded logits, without gathering the vocabulary.

Megatron's output layer (``parallel_output=True``) leaves each tensor-parallel rank with a contiguous
slice ``[..., V/tp]`` of the logits ``x``. With ``m`` the global row max of ``x``, ``s = (x - m) / T``,
``S = sum_j exp(s_j)`` and ``p = softmax(x / T) = exp(s) / S``::

    log p(t) = s_t - log S
    H        = -sum_j p_j log p_j = log S - sum_j p_j s_j

Every sum splits over the shards, so the forward needs one all-reduce MAX (of ``m``) and one all-reduce
SUM of the stacked per-shard ``[S, s_t, sum_j exp(s_j) s_j]``. The backward is purely local::

    d log p(t) / dx_j = (onehot_j(t) - p_j) / T
    dH / dx_j         = -p_j (log p_j + H) / T

so each rank needs only its own shard plus the per-row ``m``, ``log S`` and ``H`` saved by the forward.
This is correct under Megatron's TP convention, where every rank computes the same loss from the
replicated outputs: each rank receives the full upstream gradient and returns the gradient of its shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

__all__ = ["token_logprobs_and_entropy"]

# Padding columns are filled with the most negative finite fp32 rather than -inf: exp() still gives exactly
# 0, and the products p * (z - m) in the entropy stay 0 instead of becoming 0 * -inf = NaN.
_PADDING_LOGIT = torch.finfo(torch.float32).min


def token_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    tp_group: ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``targets`` and entropy of ``softmax(logits / temperature)``, vocab split over ``tp_group``.

    Args:
        logits: this rank's contiguous vocab shard ``[..., V_local]``, any float dtype (bf16 included).
            Every rank must hold the same ``V_local``; rank ``r`` holds columns ``[r * V_local, (r+1) * V_local)``.
        targets: global token ids, shape ``logits.shape[:-1]``, each in ``[0, valid_vocab_size)``.
        tp_group: the tensor-parallel group the vocabulary is split over; ``None`` or size 1 means unsplit.
        vocab_start_index: global index of this shard's first column. Derived from the rank in ``tp_group``
            when omitted; pass it only to evaluate one shard of a split in a single process.
        valid_vocab_size: true vocabulary size; columns at or beyond it are padding with probability 0 and
            zero gradient (a whole shard may be padding). ``None`` means no padding.
        temperature: sampling temperature ``T > 0``; the distribution is ``softmax(logits / T)``.
        with_entropy: also return the entropy; when False the second output is ``None``.

    Returns:
        ``(logprobs, entropy)``, both fp32 with shape ``logits.shape[:-1]``, identical on every rank of the
        group. Differentiable with respect to ``logits``; the math is fp32 whatever the input dtype.
    """
    tp_group, vocab_start_index = check_logprob_args(logits, targets, tp_group, vocab_start_index, temperature)
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(
        logits, targets, tp_group, vocab_start_index, valid_vocab_size, float(temperature), with_entropy
    )
    return logprobs, entropy


def check_logprob_args(
    logits: Tensor,
    targets: Tensor,
    tp_group: ProcessGroup | None,
    vocab_start_index: int | None,
    temperature: float,
) -> tuple[ProcessGroup | None, int]:
    """Validate the arguments shared by every implementation; return the effective group (None when it has one
    rank) and this shard's first global column (derived from the rank in the group)."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    if tp_group is not None:
        derived_start = dist.get_rank(tp_group) * logits.shape[-1]
        if vocab_start_index is not None and vocab_start_index != derived_start:
            raise ValueError(
                f"vocab_start_index={vocab_start_index} contradicts the rank in tp_group (expected {derived_start})"
            )
        return tp_group, derived_start
    return None, 0 if vocab_start_index is None else vocab_start_index


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Autograd wrapper: forward with two all-reduces, collective-free backward (see module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx stub declares neither saved_tensors nor the attributes stored on it
        logits: Tensor,
        targets: Tensor,
        group: ProcessGroup | None,
        vocab_start_index: int,
        valid_vocab_size: int | None,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        padding = _padding_columns(logits, vocab_start_index, valid_vocab_size)
        shifted = _masked_fp32(logits, padding)
        row_max = shifted.amax(dim=-1)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        _shift_and_scale_(shifted, row_max, padding, temperature)
        stats = _shard_stats(shifted, targets, vocab_start_index, with_entropy)
        del shifted
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        logprobs, entropy, log_sum_exp = _combine_stats(stats)

        ctx.save_for_backward(logits, targets, row_max, log_sum_exp, entropy)
        ctx.shard = (vocab_start_index, valid_vocab_size, temperature)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None) -> tuple:
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        logits, targets, row_max, log_sum_exp, entropy = ctx.saved_tensors
        grad_logits = _shard_grad(
            logits, targets, row_max, log_sum_exp, entropy, grad_logprobs, grad_entropy, *ctx.shard
        )
        return grad_logits, None, None, None, None, None, None


def _all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None) -> None:
    """In-place all-reduce over ``group``; a no-op when the vocabulary is not split."""
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _padding_columns(logits: Tensor, vocab_start_index: int, valid_vocab_size: int | None) -> Tensor | None:
    """Bool ``[V_local]`` marking this shard's padding columns, or ``None`` if it has none."""
    vocab_end_index = vocab_start_index + logits.shape[-1]
    if valid_vocab_size is None or vocab_end_index <= valid_vocab_size:
        return None
    return torch.arange(vocab_start_index, vocab_end_index, device=logits.device) >= valid_vocab_size


def _masked_fp32(logits: Tensor, padding: Tensor | None) -> Tensor:
    """Fresh fp32 copy of ``logits`` with padding columns set to ``_PADDING_LOGIT``; its row max is this shard's."""
    z = logits.to(torch.float32, copy=True)
    if padding is not None:
        z.masked_fill_(padding, _PADDING_LOGIT)
    return z


def _shift_and_scale_(z: Tensor, row_max: Tensor, padding: Tensor | None, temperature: float) -> Tensor:
    """In place ``z <- (z - row_max) / T``, padding reset to ``_PADDING_LOGIT``.

    Shifting before scaling keeps the large-probability entries (``z`` near the max) exact in fp32; the
    division by a small ``T`` could otherwise turn the padding value into -inf.
    """
    z.sub_(row_max.unsqueeze(-1))
    if temperature != 1.0:
        z.div_(temperature)
    if padding is not None:
        z.masked_fill_(padding, _PADDING_LOGIT)
    return z


def _local_targets(targets: Tensor, vocab_start_index: int, vocab_local: int) -> tuple[Tensor, Tensor]:
    """Targets as column indices into this shard (0 where absent) and the mask of rows whose target is here."""
    local = targets - vocab_start_index
    in_shard = (local >= 0) & (local < vocab_local)
    return local.masked_fill(~in_shard, 0), in_shard


def _shard_stats(shifted: Tensor, targets: Tensor, vocab_start_index: int, with_entropy: bool) -> Tensor:
    """This shard's additive statistics ``[..., 2 or 3]`` of ``s = (logits - global row max) / T``.

    Columns: ``sum_j exp(s_j)``, ``s_t`` if the target is in this shard else 0, and (with entropy)
    ``sum_j exp(s_j) * s_j``. Summing them over the shards gives the full-vocabulary statistics.
    """
    local, in_shard = _local_targets(targets, vocab_start_index, shifted.shape[-1])
    target_shifted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
    exp = shifted.exp()
    columns = [exp.sum(dim=-1), target_shifted]
    if with_entropy:
        columns.append(exp.mul_(shifted).sum(dim=-1))
    return torch.stack(columns, dim=-1)


def _combine_stats(stats: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """Log-probs, entropy (or ``None``) and ``log S`` from the statistics summed over all shards."""
    log_sum_exp = stats[..., 0].log()
    logprobs = stats[..., 1] - log_sum_exp
    entropy = log_sum_exp - stats[..., 2] / stats[..., 0] if stats.shape[-1] == 3 else None
    return logprobs, entropy, log_sum_exp


def _shard_grad(
    logits: Tensor,
    targets: Tensor,
    row_max: Tensor,
    log_sum_exp: Tensor,
    entropy: Tensor | None,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    vocab_start_index: int,
    valid_vocab_size: int | None,
    temperature: float,
) -> Tensor:
    """Gradient of this shard's logits: ``(g_lp (onehot - p) - g_H p (log p + H)) / T``, 0 on padding."""
    padding = _padding_columns(logits, vocab_start_index, valid_vocab_size)
    log_p = _shift_and_scale_(_masked_fp32(logits, padding), row_max, padding, temperature)
    log_p.sub_(log_sum_exp.unsqueeze(-1))
    p = log_p.exp()
    # grad_z = -p * (g_lp + g_H * (log p + H)) + g_lp * onehot; the bracket is built in place in log_p's buffer.
    if grad_entropy is not None:
        if entropy is None:
            raise RuntimeError("a gradient reached the entropy, but the forward ran with with_entropy=False")
        coefficient = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
        if grad_logprobs is not None:
            coefficient.add_(grad_logprobs.unsqueeze(-1))
    else:
        assert grad_logprobs is not None, "backward returns early when neither output has a gradient"
        coefficient = log_p.copy_(grad_logprobs.unsqueeze(-1).expand_as(log_p))
    grad = coefficient.mul_(p).neg_()
    if grad_logprobs is not None:
        local, in_shard = _local_targets(targets, vocab_start_index, logits.shape[-1])
        grad.scatter_add_(-1, local.unsqueeze(-1), (grad_logprobs * in_shard).unsqueeze(-1))
    if padding is not None:
        grad.masked_fill_(padding, 0.0)  # p = 0 there, but 0 * (huge log p) may have produced NaN
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)
