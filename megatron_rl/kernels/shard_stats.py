"""Per-shard softmax statistics and their combination across the tensor-parallel group (one all-gather).

Every implementation in this package (chunked torch, Triton) reduces its vocab shard of one row ``x`` (raw
logits, fp32, padding and ``-inf`` columns excluded) to four numbers, with ``m`` the shard's max and ``T`` the
temperature::

    m = max_j x_j                 d = sum_j exp((x_j - m) / T)
    s = sum_j exp((x_j - m) / T) * (x_j - m) / T          t = x_target if the target is in the shard else -inf

``s`` is centred on the shard's own max, so it never suffers the cancellation of ``sum exp(x) * x`` when the
logits are large. With ``M = max_r m_r``, ``a_r = (m_r - M) / T`` and ``w_r = exp(a_r)``::

    D = sum_r w_r d_r             S = sum_r w_r (s_r + a_r d_r)   (= sum_j exp((x_j - M)/T) (x_j - M)/T)
    log p(target) = (t - M) / T - log D                            H = log D - S / D

A shard with no valid column has ``m = -inf, d = s = 0`` and contributes nothing. Because the statistics of
each rank are self-contained, the whole exchange is ONE ``all_gather_into_tensor`` of a ``[N, 4]`` fp32 tensor
(as in Transformer Engine's ``parallel_cross_entropy``), instead of a MAX all-reduce that must finish before
the sums can even be computed, followed by a SUM all-reduce. ``combine_shard_stats`` is a pure function, so
tests can run the per-shard phase shard by shard and stack the results in place of the collective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["RowStats", "combine_shard_stats", "gather_shard_stats", "valid_local_columns"]

NUM_STATS = 4  # m, d, s, t


class RowStats(NamedTuple):
    """Full-vocabulary results per row (fp32, ``[N]``); the backward needs ``row_max``, ``log_norm``, ``entropy``."""

    logprobs: Tensor  # log p(target)
    entropy: Tensor  # H
    row_max: Tensor  # M, global max of the raw logits
    log_norm: Tensor  # log D, with D = sum_j exp((x_j - M) / T)


def valid_local_columns(vocab_local: int, vocab_start_index: int, valid_vocab_size: int | None) -> int:
    """How many leading columns of this shard are real vocabulary (the rest is padding; may be 0)."""
    if valid_vocab_size is None:
        return vocab_local
    return max(0, min(vocab_local, valid_vocab_size - vocab_start_index))


def gather_shard_stats(local: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[world, N, 4]`` statistics of every rank of ``group`` (``[1, N, 4]`` without a group): one all-gather.

    The output is gathered flat (``[world * N, 4]``): gloo rejects a 3-D output tensor for this collective.
    """
    if group is None:
        return local.unsqueeze(0)
    world = dist.get_world_size(group)
    out = local.new_empty((world * local.shape[0], NUM_STATS))
    dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    return out.view(world, local.shape[0], NUM_STATS)


def combine_shard_stats(stats: Tensor, temperature: float) -> RowStats:
    """Merge ``[world, N, 4]`` per-shard statistics (shard order irrelevant) into full-vocabulary results."""
    m, d, s, t = stats.unbind(-1)
    row_max = m.amax(dim=0)
    present = d > 0  # shards with at least one finite logit; the others would give -inf * 0 = NaN below
    offset = torch.where(present, (m - row_max) / temperature, torch.zeros_like(m))
    weight = torch.where(present, offset.exp(), torch.zeros_like(m))
    norm = (weight * d).sum(dim=0)
    centred_sum = (weight * (s + offset * d)).sum(dim=0)
    log_norm = norm.log()
    logprobs = (t.amax(dim=0) - row_max) / temperature - log_norm
    entropy = log_norm - centred_sum / norm
    return RowStats(logprobs, entropy, row_max, log_norm)
