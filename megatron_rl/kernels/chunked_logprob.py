"""Vocab-parallel token log-probs and entropy in torch, computed a chunk of rows at a time.

Same results as ``kernels.reference_logprob.token_logprobs_and_entropy``, but the fp32 work buffers are
``[chunk_rows, V_local]`` instead of ``[tokens, V_local]``: the forward reduces each chunk to the per-shard
statistics of ``shard_stats`` and the backward recomputes the softmax of each chunk from the saved logits.
Peak extra memory is therefore O(chunk_rows x V_local) fp32 plus the gradient itself (logits' dtype).
Across the tensor-parallel group the only communication is one all-gather of ``[N, 4]`` fp32 statistics.
This is the CPU default and the oracle of the Triton kernel.

Logits equal to ``-inf`` (masked tokens) are allowed, also for a whole shard: they get probability 0, zero
gradient and contribute ``0 * log 0 := 0`` to the entropy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from megatron_rl.kernels.shard_stats import (
    NUM_STATS,
    RowStats,
    combine_shard_stats,
    gather_shard_stats,
    valid_local_columns,
)

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "chunked_logprobs_and_entropy", "shard_grad", "shard_stats"]

# 2**24 fp32 = 64 MiB per work buffer: 110 rows of a 151,936 vocabulary.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(vocab_local: int, chunk_rows: int | None) -> int:
    return chunk_rows if chunk_rows is not None else max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab_local, 1))


def _local_targets(targets: Tensor, vocab_start_index: int, n_valid: int) -> tuple[Tensor, Tensor]:
    """Targets as column indices into this shard (0 where absent) and the mask of rows whose target is here."""
    local = targets - vocab_start_index
    in_shard = (local >= 0) & (local < n_valid)
    return local.masked_fill(~in_shard, 0), in_shard


def shard_stats(
    logits: Tensor,
    targets: Tensor,
    *,
    vocab_start_index: int,
    n_valid: int,
    temperature: float,
    chunk_rows: int | None = None,
) -> Tensor:
    """``[N, 4]`` fp32 statistics (m, d, s, t of ``shard_stats``) of a 2-D shard ``[N, V_local]``, chunk by chunk."""
    n_rows = logits.shape[0]
    out = torch.empty((n_rows, NUM_STATS), dtype=torch.float32, device=logits.device)
    if n_valid == 0:  # the whole shard is padding
        out[:, 0], out[:, 1], out[:, 2], out[:, 3] = -torch.inf, 0.0, 0.0, -torch.inf
        return out
    local, in_shard = _local_targets(targets, vocab_start_index, n_valid)
    step = _chunk_rows(n_valid, chunk_rows)
    for begin in range(0, n_rows, step):
        rows = slice(begin, begin + step)
        x = logits[rows, :n_valid].float()
        m = x.amax(dim=-1, keepdim=True)
        finite = x > -torch.inf
        z = torch.where(finite, (x - torch.where(m > -torch.inf, m, 0.0)) / temperature, -torch.inf)
        e = z.exp()
        out[rows, 0] = m.squeeze(-1)
        out[rows, 1] = e.sum(dim=-1)
        out[rows, 2] = torch.where(finite, e * z, 0.0).sum(dim=-1)
        target = x.gather(-1, local[rows].unsqueeze(-1)).squeeze(-1)
        out[rows, 3] = torch.where(in_shard[rows], target, -torch.inf)
    return out


def shard_grad(
    logits: Tensor,
    targets: Tensor,
    row_stats: RowStats,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    *,
    vocab_start_index: int,
    n_valid: int,
    temperature: float,
    chunk_rows: int | None = None,
) -> Tensor:
    """Gradient of a 2-D shard: ``(g_lp (onehot - p) - g_H p (log p + H)) / T``, 0 on padding and ``p = 0``."""
    grad = torch.zeros_like(logits)
    if n_valid == 0 or (grad_logprobs is None and grad_entropy is None):
        return grad
    local, in_shard = _local_targets(targets, vocab_start_index, n_valid)
    step = _chunk_rows(n_valid, chunk_rows)
    for begin in range(0, logits.shape[0], step):
        rows = slice(begin, begin + step)
        log_p = logits[rows, :n_valid].to(torch.float32, copy=True)
        log_p.sub_(row_stats.row_max[rows, None]).div_(temperature).sub_(row_stats.log_norm[rows, None])
        p = log_p.exp()
        if grad_entropy is not None:
            coefficient = log_p.add_(row_stats.entropy[rows, None]).mul_(grad_entropy[rows, None])
            if grad_logprobs is not None:
                coefficient.add_(grad_logprobs[rows, None])
        else:
            assert grad_logprobs is not None, "returned early when neither output has a gradient"
            coefficient = log_p.copy_(grad_logprobs[rows, None].expand_as(log_p))
        g = coefficient.mul_(p).neg_()
        g.masked_fill_(p == 0, 0.0)  # -inf logits: 0 * (-inf) would be NaN
        if grad_logprobs is not None:
            g.scatter_add_(-1, local[rows, None], (grad_logprobs[rows] * in_shard[rows]).unsqueeze(-1))
        if temperature != 1.0:
            g.div_(temperature)
        grad[rows, :n_valid] = g
    return grad


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Forward: per-shard stats, one all-gather, combine. Backward: local, chunked recomputation."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx stub declares neither saved_tensors nor the attributes stored on it
        logits: Tensor,
        targets: Tensor,
        group: ProcessGroup | None,
        vocab_start_index: int,
        n_valid: int,
        temperature: float,
        chunk_rows: int | None,
    ) -> tuple[Tensor, Tensor]:
        shape = (vocab_start_index, n_valid, temperature, chunk_rows)
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        local = shard_stats(flat, flat_targets, vocab_start_index=shape[0], n_valid=n_valid, temperature=temperature,
                            chunk_rows=chunk_rows)  # fmt: skip
        row_stats = combine_shard_stats(gather_shard_stats(local, group), temperature)
        ctx.save_for_backward(logits, targets, *row_stats)
        ctx.shard = shape
        ctx.set_materialize_grads(False)
        out_shape = logits.shape[:-1]
        return row_stats.logprobs.view(out_shape), row_stats.entropy.view(out_shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None) -> tuple:
        logits, targets, *row_stats = ctx.saved_tensors
        vocab_start_index, n_valid, temperature, chunk_rows = ctx.shard
        flat = logits.reshape(-1, logits.shape[-1])
        grad = shard_grad(
            flat,
            targets.reshape(-1),
            RowStats(*row_stats),
            None if grad_logprobs is None else grad_logprobs.reshape(-1).float(),
            None if grad_entropy is None else grad_entropy.reshape(-1).float(),
            vocab_start_index=vocab_start_index,
            n_valid=n_valid,
            temperature=temperature,
            chunk_rows=chunk_rows,
        )
        return grad.view_as(logits), None, None, None, None, None, None


def chunked_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    tp_group: ProcessGroup | None,
    vocab_start_index: int,
    valid_vocab_size: int | None,
    temperature: float,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(logprobs, entropy)`` fp32 ``logits.shape[:-1]``; arguments already validated by the dispatcher."""
    n_valid = valid_local_columns(logits.shape[-1], vocab_start_index, valid_vocab_size)
    return _ChunkedLogprobEntropy.apply(
        logits, targets, tp_group, vocab_start_index, n_valid, float(temperature), chunk_rows
    )
