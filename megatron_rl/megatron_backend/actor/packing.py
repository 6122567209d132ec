"""Sequence packing: the samples of a micro-batch laid end to end in one row, without padding between them.

`Packing` says where each sample lies in the packed row and converts per-sample tensors (`[n, s, ...]`, as in
`TokenBatch`) to the packed row (`[1, total, ...]`) and back. The model sees the row in Megatron's THD format
(`PackedSeqParams` with `cu_seqlens`): each sample attends only to itself and gets its own rotary positions
0..length-1, so its log-probs equal those of the padded layout up to rounding. The row ends with padding up to
`total` (a multiple the sequence-parallel split needs, or the fixed token budget of a pipeline), which forms one
more segment of its own and never reaches a loss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Packing:
    """Sample j of a micro-batch occupies positions `starts[j] : starts[j] + lengths[j]` of the packed row."""

    lengths: tuple[int, ...]
    total: int

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"packed samples need at least one token each, got lengths {self.lengths}")
        if sum(self.lengths) > self.total:
            raise ValueError(f"{sum(self.lengths)} tokens do not fit a packed row of {self.total}")

    @classmethod
    def of(cls, lengths: list[int], *, multiple: int = 1, total: int | None = None) -> Packing:
        """The packing of samples of `lengths`; the row is `total` long (default: their sum rounded up to
        `multiple`)."""
        used = sum(lengths)
        size = -(-used // multiple) * multiple if total is None else total
        if size % multiple:
            raise ValueError(f"a packed row of {size} tokens is not a multiple of {multiple}")
        return cls(tuple(int(n) for n in lengths), size)

    @property
    def used(self) -> int:
        return sum(self.lengths)

    def segments(self) -> list[int]:
        """The segment lengths of the row: the samples, then the trailing padding if there is any."""
        pad = self.total - self.used
        return [*self.lengths, pad] if pad else list(self.lengths)

    def cu_seqlens(self) -> torch.Tensor:
        """`[segments + 1]` int32 offsets of the segments (Megatron's and Transformer Engine's `cu_seqlens`)."""
        return torch.tensor([0, *torch.tensor(self.segments()).cumsum(0).tolist()], dtype=torch.int32)

    def positions(self) -> torch.Tensor:
        """`[1, total]`: each token's position within its own segment."""
        return _positions_within(torch.tensor(self.segments()), self.total).unsqueeze(0)

    @functools.cached_property
    def _rows_cols(self) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor(self.lengths)
        rows = torch.repeat_interleave(torch.arange(len(self.lengths)), lengths, output_size=self.used)
        return rows, _positions_within(lengths, self.used)

    def _index(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the per-sample layout, in packed order, for the samples' tokens."""
        if max(self.lengths) > width:
            raise ValueError(f"a sample of {max(self.lengths)} tokens does not fit the per-sample width {width}")
        return self._rows_cols

    def pack(self, per_sample: torch.Tensor, fill: int | float | bool = 0) -> torch.Tensor:
        """`[n, s, ...]` -> `[1, total, ...]`: the samples' first `lengths[j]` positions end to end, then `fill`."""
        rows, cols = self._index(per_sample.shape[1])
        tokens = per_sample[rows, cols]
        pad = per_sample.new_full((self.total - self.used, *per_sample.shape[2:]), fill)
        return torch.cat([tokens, pad]).unsqueeze(0)

    def unpack(self, packed: torch.Tensor, width: int, fill: int | float = 0) -> torch.Tensor:
        """`[1, total, ...]` -> `[n, width, ...]`: each sample's tokens at its own positions, `fill` after them
        (differentiable: a gather)."""
        rows, cols = self._index(width)
        flat = packed[0, : self.used]
        out = flat.new_full((len(self.lengths), width, *flat.shape[1:]), fill)
        return out.index_put((rows.to(flat.device), cols.to(flat.device)), flat)

    def seq_params(self, device: torch.device) -> Any:
        """Megatron's `PackedSeqParams` for this row (THD: one segment per sample, then the padding)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens().to(device)
        longest = max(self.segments())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )


def _positions_within(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """`[total]`: 0..n-1 for each of the consecutive segments of `lengths` (summing to `total`), in a few
    operators whatever their number (a micro-batch packs tens of samples)."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total) - torch.repeat_interleave(starts, lengths, output_size=total)
