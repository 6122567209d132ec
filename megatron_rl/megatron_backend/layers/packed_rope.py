"""Rotary embeddings of a packed (THD) row in one pass instead of one per sample.

Megatron's unfused THD path (`rope_utils._apply_rotary_pos_emb_thd`, taken whenever `apply_rope_fusion` is off:
on CPU, and on GPU unless Transformer Engine's fused RoPE is switched on) splits the row and slices the
frequencies once per sample, for the queries and for the keys of every layer: at the demo's 32 samples per
micro-batch that is 240 of the scoring forward's 825 top-level operators (`benchmarks/bench_op_counts.py`).

`one_pass_thd` gathers each token's frequencies with one index (its position within its sample) and rotates the
row as a single segment with Megatron's own formula, its cosines and sines computed once per forward rather than
for the queries and again for the keys of every layer: the same output and gradient bit for bit
(tests/megatron_backend/layers/test_packed_rope.py, on megatron-core 0.16, which rotates the gathered row at once,
and 0.19, which rotates each sample on its own). Context parallelism (a CP group of more than one rank) keeps Megatron's
path, which also splits each sample over ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def thd_frequencies(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int) -> torch.Tensor:
    """`[total, 1, 1, d]`: the frequencies of each token of a packed row of `total` tokens, as Megatron's one-rank
    THD path picks them. With `freqs` for the whole row (`freqs.size(0) == total`) a token keeps its row
    position's; otherwise (`freqs` of the longest sample) it gets its position within its own sample's. Reads no
    tensor value on the host (no device synchronisation)."""
    if freqs.size(0) == total:
        return freqs
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=total)
    return freqs[torch.arange(total, device=freqs.device) - starts]


def one_pass_thd(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`original` (Megatron's `_apply_rotary_pos_emb_thd`) applied to the packed row as one segment.

    Without multi-latent attention the rotation is Megatron's `_apply_rotary_pos_emb_bshd` formula written out
    (`t * cos + rotate_half(t) * sin`, the same operators on the same values), with the row's gathered cosines and
    sines computed once and reused by the queries and keys of every layer of the forward (they share
    `cu_seqlens` and `freqs`: one entry, matched by identity, is kept)."""
    last: list[tuple[Any, ...]] = []

    def factors(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int, dtype: torch.dtype, mscale: float):
        if last and last[0][0] is cu_seqlens and last[0][1] is freqs and last[0][2:4] == (dtype, mscale):
            return last[0][4:]
        gathered = thd_frequencies(cu_seqlens, freqs, total)
        cos, sin = (torch.cos(gathered) * mscale).to(dtype), (torch.sin(gathered) * mscale).to(dtype)
        last[:] = [(cu_seqlens, freqs, dtype, mscale, cos, sin)]
        return cos, sin

    @functools.wraps(original)
    def apply(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *args: Any, **kwargs: Any):
        cp_group = kwargs.get("cp_group")
        if cp_group is None or cp_group.size() != 1:
            return original(t, cu_seqlens, freqs, *args, **kwargs)
        total = t.size(0)  # on one CP rank the row is all of cu_seqlens' tokens
        if args or kwargs.get("multi_latent_attention") or kwargs.get("mla_rotary_interleaved"):
            whole = torch.tensor([0, total], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            return original(t, whole, thd_frequencies(cu_seqlens, freqs, total), *args, **kwargs)
        from megatron.core.models.common.embeddings.rope_utils import _rotate_half

        cos, sin = factors(cu_seqlens, freqs, total, t.dtype, kwargs.get("mscale", 1.0))
        rotated, passed = t[..., : freqs.shape[-1]].unsqueeze(1), t[..., freqs.shape[-1] :].unsqueeze(1)
        rotated = (rotated * cos) + (_rotate_half(rotated, kwargs.get("rotary_interleaved", False)) * sin)
        return (torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated).squeeze(1)

    apply.one_pass_thd = True  # type: ignore[attr-defined]
    return apply


def use_one_pass_thd_rope() -> None:
    """Route Megatron's unfused THD RoPE through `one_pass_thd` (once per process; idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    if not getattr(rope_utils._apply_rotary_pos_emb_thd, "one_pass_thd", False):
        rope_utils._apply_rotary_pos_emb_thd = one_pass_thd(rope_utils._apply_rotary_pos_emb_thd)
