"""Fused Triton kernels for vocab-parallel token log-probs and entropy (design after Transformer Engine's
``parallel_cross_entropy``, Apache-2.0: one program per row, online max/sum-exp, one all-gather of stats).

* ``_shard_stats_kernel``: one program per row streams the shard's valid columns in ``BLOCK`` chunks and keeps a
  running ``(m, d, s)`` (online softmax; see ``shard_stats`` for the definitions) plus the target logit, and
  writes the ``[N, 4]`` fp32 statistics. No ``[N, V]`` buffer is written.
* The statistics of all ranks are all-gathered and merged by ``combine_shard_stats`` (torch, O(N x tp)).
* ``_shard_grad_kernel``: one program per row recomputes ``p`` block by block from the saved logits and the
  per-row ``(M, log D, H)`` and writes ``(g_lp (onehot - p) - g_H p (log p + H)) / T`` in the logits' dtype,
  without materialising an fp32 softmax.

Only plain ``tl.*`` operations are used, so the same source runs compiled on a GPU and, with
``TRITON_INTERPRET=1`` set *before this module is imported*, on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
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

__all__ = ["triton_logprobs_and_entropy", "triton_shard_grad", "triton_shard_stats"]

MAX_BLOCK = 8192


def _block_size(n_cols: int) -> int:
    return max(16, min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1))))


@triton.jit
def _shard_stats_kernel(
    X,
    stride_x,
    Y,
    STATS,
    n_valid,
    vocab_start,
    temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    m = -float("inf")
    d = 0.0
    s = 0.0
    for start in range(0, n_valid, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_valid, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # Rescale the running sums to the new max; while nothing finite was seen (m = -inf) they are 0.
        a = tl.where(m > -float("inf"), (m - m_new) / temperature, 0.0)
        w = tl.exp(a)
        s = w * (s + a * d)
        d = w * d
        finite = x > -float("inf")
        z = tl.where(finite, (x - tl.where(finite, m_new, 0.0)) / temperature, -float("inf"))
        e = tl.exp(z)
        d += tl.sum(e, axis=0)
        s += tl.sum(tl.where(finite, e * z, 0.0), axis=0)
        m = m_new
    target = tl.load(Y + row) - vocab_start
    in_shard = (target >= 0) & (target < n_valid)
    t = tl.load(x_row + tl.where(in_shard, target, 0), mask=in_shard, other=-float("inf")).to(tl.float32)
    out = STATS + row * 4
    tl.store(out, m)
    tl.store(out + 1, d)
    tl.store(out + 2, s)
    tl.store(out + 3, t)


@triton.jit
def _shard_grad_kernel(
    X,
    stride_x,
    Y,
    ROW_MAX,
    LOG_NORM,
    ENTROPY,
    G_LP,
    G_H,
    DX,
    stride_dx,
    n_cols,
    n_valid,
    vocab_start,
    temperature,
    HAS_G_LP: tl.constexpr,
    HAS_G_H: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    dx_row = DX + row * stride_dx
    row_max = tl.load(ROW_MAX + row)
    log_norm = tl.load(LOG_NORM + row)
    entropy = tl.load(ENTROPY + row)
    g_lp = tl.load(G_LP + row) if HAS_G_LP else 0.0
    g_h = tl.load(G_H + row) if HAS_G_H else 0.0
    target = tl.load(Y + row) - vocab_start
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_valid, other=-float("inf")).to(tl.float32)
        log_p = (x - row_max) / temperature - log_norm
        p = tl.exp(log_p)
        grad = -p * (g_lp + g_h * (log_p + entropy))
        grad = tl.where(p > 0, grad, 0.0)  # padding / -inf logits: p = 0 and 0 * -inf would be NaN
        grad += tl.where(cols == target, g_lp, 0.0)
        grad = grad / temperature
        tl.store(dx_row + cols, grad.to(DX.dtype.element_ty), mask=cols < n_cols)


def triton_shard_stats(
    logits: Tensor, targets: Tensor, *, vocab_start_index: int, n_valid: int, temperature: float
) -> Tensor:
    """``[N, 4]`` fp32 statistics of a 2-D shard ``[N, V_local]`` (unit column stride); see ``shard_stats``."""
    n_rows = logits.shape[0]
    stats = torch.empty((n_rows, NUM_STATS), dtype=torch.float32, device=logits.device)
    if n_rows:
        _shard_stats_kernel[(n_rows,)](
            logits, logits.stride(0), targets, stats, n_valid, vocab_start_index, temperature,
            BLOCK=_block_size(n_valid), num_warps=8,
        )  # fmt: skip
    return stats


def triton_shard_grad(
    logits: Tensor,
    targets: Tensor,
    row_stats: RowStats,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    *,
    vocab_start_index: int,
    n_valid: int,
    temperature: float,
) -> Tensor:
    """Gradient of a 2-D shard, in ``logits.dtype``; 0 on padding columns and wherever ``p = 0``."""
    n_rows, n_cols = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n_rows:
        dummy = row_stats.row_max
        _shard_grad_kernel[(n_rows,)](
            logits, logits.stride(0), targets, row_stats.row_max, row_stats.log_norm, row_stats.entropy,
            dummy if grad_logprobs is None else grad_logprobs, dummy if grad_entropy is None else grad_entropy,
            grad, grad.stride(0), n_cols, n_valid, vocab_start_index, temperature,
            HAS_G_LP=grad_logprobs is not None, HAS_G_H=grad_entropy is not None,
            BLOCK=_block_size(n_cols), num_warps=8,
        )  # fmt: skip
    return grad


def _as_rows(logits: Tensor) -> Tensor:
    """``[N, V_local]`` view with unit column stride (copies only if the last dimension is strided)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class _TritonLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx stub declares neither saved_tensors nor the attributes stored on it
        logits: Tensor,
        targets: Tensor,
        group: ProcessGroup | None,
        vocab_start_index: int,
        n_valid: int,
        temperature: float,
    ) -> tuple[Tensor, Tensor]:
        flat_targets = targets.reshape(-1).contiguous()
        local = triton_shard_stats(
            _as_rows(logits),
            flat_targets,
            vocab_start_index=vocab_start_index,
            n_valid=n_valid,
            temperature=temperature,
        )
        row_stats = combine_shard_stats(gather_shard_stats(local, group), temperature)
        ctx.save_for_backward(logits, flat_targets, *row_stats)
        ctx.shard = (vocab_start_index, n_valid, temperature)
        ctx.set_materialize_grads(False)
        out_shape = logits.shape[:-1]
        return row_stats.logprobs.view(out_shape), row_stats.entropy.view(out_shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None) -> tuple:
        logits, flat_targets, *row_stats = ctx.saved_tensors
        vocab_start_index, n_valid, temperature = ctx.shard
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad = triton_shard_grad(
            _as_rows(logits),
            flat_targets,
            RowStats(*row_stats),
            None if grad_logprobs is None else grad_logprobs.reshape(-1).float().contiguous(),
            None if grad_entropy is None else grad_entropy.reshape(-1).float().contiguous(),
            vocab_start_index=vocab_start_index,
            n_valid=n_valid,
            temperature=temperature,
        )
        return grad.view(logits.shape), None, None, None, None, None


def triton_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    tp_group: ProcessGroup | None,
    vocab_start_index: int,
    valid_vocab_size: int | None,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """``(logprobs, entropy)`` fp32 ``logits.shape[:-1]``; arguments already validated by the dispatcher."""
    n_valid = valid_local_columns(logits.shape[-1], vocab_start_index, valid_vocab_size)
    return _TritonLogprobEntropy.apply(logits, targets, tp_group, vocab_start_index, n_valid, float(temperature))
