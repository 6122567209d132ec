"""This rank's share of a batch: its data-parallel rows, their micro-batches, and the reassembled results.

Row rule (owned here, asked for by routing replay): the rows of a batch are split over data-parallel ranks by a
token-balanced partition of their lengths (`balance.balanced_partition`), which every rank computes alike.
Within a rank, packed micro-batches are balanced too (`balance.split_micro_batches`); the rank's rows are then
kept in micro-batch order, with their indices in the batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.balance import balanced_partition, imbalance, split_micro_batches
from megatron_rl.megatron_backend.actor.batch import TokenBatch, split_by_token_budget
from megatron_rl.megatron_backend.actor.packing import Packing
from megatron_rl.parallel_layout import ParallelLayout


def data_parallel_partition(lengths: list[int], quadratic: float = 0.0) -> list[list[int]]:
    """The rows each data-parallel rank feeds of a batch whose sequences have `lengths` (same on every rank); a
    sample costs `length + quadratic * length^2`."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if len(lengths) < dp:
        raise ValueError(f"batch of {len(lengths)} samples is smaller than the data-parallel size {dp}")
    return balanced_partition(lengths, dp, alpha=quadratic) if dp > 1 else [list(range(len(lengths)))]


@dataclass
class RankPlan:
    """This rank's rows of a batch, in the order its micro-batches run them."""

    shard: TokenBatch  # this rank's rows, in micro-batch order
    index: list[int]  # their rows in the batch
    batches: list[TokenBatch]  # the micro-batches (consecutive rows of `shard`)
    dp_imbalance: float  # max / mean tokens per data-parallel rank


def plan_micro_batches(
    batch: TokenBatch,
    max_tokens: int,
    layout: ParallelLayout,
    dp_group,
    *,
    packing: bool = True,
    quadratic: float = 0.0,
) -> RankPlan:
    """This rank's rows and micro-batches, as many on every data-parallel rank; under pipeline parallelism all get
    one fixed shape. A batch with `dp_share` set is already this rank's rows, in the order it feeds them; any
    other batch is the whole batch on every rank, and this rank takes its share of it here.

    `packing`: each micro-batch is packed (`TokenBatch.packing`): its samples end to end in one row of at most
    `max_tokens` tokens (a longer sample alone), padded only at the end, to a multiple of TP under sequence
    parallelism (and to the longest row under PP); the rank's samples are spread over its micro-batches with
    balanced costs (a sample costs `length + quadratic * length^2`, as in the data-parallel split). Otherwise each
    sample is a row, padded to the longest (count x longest <= `max_tokens`), consecutive samples per micro-batch.

    Expert-parallel all-to-alls span data-parallel ranks, so every rank must run the same number of
    micro-batches (a rank with fewer samples gets dummy rows). Megatron's variable-shape p2p path exchanges
    shapes with batched send/recv, which mis-pairs messages when the previous and next stage are the same rank
    (PP=2); fixed shapes avoid it.
    """
    from megatron.core import parallel_state as ps

    lengths = batch.lengths.tolist()
    if batch.dp_share is None:
        partition = data_parallel_partition(lengths, quadratic)
        index = partition[ps.get_data_parallel_rank()]
        dp_imbalance = imbalance(lengths, partition)
    else:
        index, dp_imbalance = list(range(len(lengths))), batch.dp_share.imbalance
    mine = [lengths[i] for i in index]
    if packing:
        groups = split_micro_batches(mine, max_tokens, alpha=quadratic)
    else:
        groups = split_by_token_budget(mine, max_tokens)
    count = torch.tensor([len(groups)])
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    count_needed = micro_batch_count(int(count), layout)
    if count_needed > len(groups):  # another rank (or the VPP schedule) needs more: refit to that count
        if packing:
            groups = split_micro_batches(mine, max_tokens, min_count=count_needed, alpha=quadratic)
        else:
            groups = regroup(groups, count_needed)
    order = [i for g in groups for i in g]
    index = [index[i] for i in order]
    shard = batch.select(index)
    ranges, start = [], 0
    for g in groups:
        ranges.append(list(range(start, start + len(g))))
        start += len(g)
    return RankPlan(shard, index, _micro_batches(shard, ranges, layout, packing), dp_imbalance)


def _micro_batches(shard: TokenBatch, groups: list[list[int]], layout: ParallelLayout, packing: bool):
    multiple = layout.tp if layout.sequence_parallel else 1
    if packing:
        views = [shard.select(g, rows=max(len(g), 1)) for g in groups]
        used = max(int(v.lengths.sum()) for v in views)
        total = -(-used // multiple) * multiple if layout.pp > 1 else None
        return [
            dataclasses.replace(v, packing=Packing.of(v.lengths.tolist(), multiple=multiple, total=total))
            for v in views
        ]
    if layout.pp == 1:
        return [shard.select(g, pad_to_multiple=multiple, rows=max(len(g), 1)) for g in groups]
    seq, rows = int(shard.lengths.max()), max(max(len(g) for g in groups), 1)
    return [shard.select(g, pad_to_multiple=multiple, seq_len=seq, rows=rows) for g in groups]


def model_inputs(mb: TokenBatch) -> dict[str, Any]:
    """The GPT model's forward arguments for micro-batch `mb` (packed: THD with `cu_seqlens`)."""
    device = platform.device()
    ids = mb.model_tokens().to(device)
    if mb.packing is None:
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
        return {"input_ids": ids, "position_ids": positions, "attention_mask": None}
    return {
        "input_ids": ids,
        "position_ids": mb.packing.positions().to(device),
        "attention_mask": None,
        "packed_seq_params": mb.packing.seq_params(device),
    }


def schedule_shape(batches: list[TokenBatch]) -> tuple[int, int]:
    """(seq_length, micro_batch_size) of the activations Megatron's schedule exchanges between stages."""
    shapes = [(1, mb.packing.total) if mb.packing is not None else tuple(mb.input_ids.shape) for mb in batches]
    return max(s for _, s in shapes), max(b for b, _ in shapes)


def micro_batch_count(count: int, layout: ParallelLayout) -> int:
    """The number of micro-batches to run for `count` groups: Megatron's interleaved (virtual pipeline) schedule
    runs them in groups of PP, so it needs a multiple of PP."""
    return -(-count // layout.pp) * layout.pp if layout.vpp else count


def regroup(groups: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest groups until there are `count` (empty groups, padded with a dummy row, when there are
    fewer samples than micro-batches)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) <= 1:
            groups.append([])
            continue
        half = len(groups[largest]) // 2
        groups[largest : largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return groups


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def broadcast_from_last_stage(tensor: torch.Tensor, pp_group) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    return tensor


def stack_rows(
    per_micro_batch: list[Any],
    rows: int,
    s: int,
    pp_group,
    *,
    tail: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`[rows, s, *tail]`: the micro-batches' per-row values (computed on the last pipeline stage) stacked in
    order, cut or zero-padded to width `s`, on every stage."""
    out = torch.zeros(rows, s, *tail, dtype=dtype)
    if is_last_stage():
        row = 0
        for values in per_micro_batch:
            n, w = values.shape[0], min(values.shape[1], s)
            out[row : row + n, :w] = values[:, :w]
            row += n
    return broadcast_from_last_stage(out, pp_group)


def positions_below(lengths: torch.Tensor, s: int) -> torch.Tensor:
    """Non-padding positions t in [1, length) (every token with a preceding context)."""
    pos = torch.arange(s).unsqueeze(0)
    return (pos >= 1) & (pos < lengths.unsqueeze(1))


def gather_rows(
    tensors: dict[str, Any], index: list[int], total: int, dp_group, *, gather: bool = True
) -> dict[str, Any]:
    """Reassemble full-batch tensors from the data-parallel shards (each rank holds the rows `index` names);
    `gather=False`: this rank's rows only (`total` of them), put back in the batch's order."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    parts: list = [(index, tensors)]
    if gather and dp > 1:
        parts = [None] * dp
        dist.all_gather_object(parts, (index, tensors), group=dp_group)
    out: dict[str, Any] = {}
    for name, first in parts[0][1].items():
        if first is None:
            out[name] = None
            continue
        merged = torch.zeros((total, *first.shape[1:]), dtype=first.dtype)
        for idx, shard in parts:
            merged[torch.tensor(idx)] = shard[name]
        out[name] = merged
    return out
