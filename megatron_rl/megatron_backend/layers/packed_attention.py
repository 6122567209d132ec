"""Packed (THD) sequences on the local layer spec.

Megatron-Core's local `DotProductAttention` refuses `packed_seq_params` (only Transformer Engine's attention takes
the THD format). Everything around it already handles THD: the attention module squeezes the batch dimension and
applies rotary embeddings per segment from `cu_seqlens`. `with_local_core_attention(spec, packed_variant)` swaps
each local core attention class of a decoder block spec for a subclass that runs the parent's own causal attention
(Megatron's unfused one, or SDPA's: `sdpa_attention.sdpa_variant`) on the segments, grouped by length into padded
batches, so a packed sample is computed as the same sample alone (up to rounding). One call per length group
rather than one over the whole row with a block-diagonal mask: the mask would cost the square of the row's length,
the groups the sum of their own squares. Transformer Engine's attention is left as it is (it runs THD natively on
the GPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

ALONE_FROM = 128  # tokens: a segment this long gets an attention call of its own


@functools.cache
def packed_variant(cls: type) -> type:
    """A subclass of the local core attention `cls` that accepts THD `packed_seq_params`."""

    class PackedCoreAttention(cls):
        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
            if attention_mask is not None:
                raise ValueError("packed sequences take their causal masks from cu_seqlens, not an attention mask")
            # query/key/value arrive [tokens, heads, dim] (the attention squeezed the batch dimension).
            cu_seqlens = tuple(packed_seq_params.cu_seqlens_q.tolist())
            buckets, order = _length_buckets(cu_seqlens, query.shape[0], query.device)
            rows = []
            for gather, keep in buckets:
                context = super().forward(
                    query[gather], key[gather], value[gather], None, attn_mask_type, attention_bias
                )  # [longest, samples, heads * dim]
                rows.append(context.reshape(-1, context.shape[-1])[keep])
            if cu_seqlens[-1] < query.shape[0]:  # tokens after the last segment: zeros
                rows.append(rows[0].new_zeros(1, rows[0].shape[-1]))
            return torch.cat(rows)[order]  # [tokens, heads * dim], as Transformer Engine's attention returns THD

    PackedCoreAttention.__name__ = PackedCoreAttention.__qualname__ = f"Packed{cls.__name__}"
    return PackedCoreAttention


@functools.lru_cache(maxsize=16)
def _length_buckets(
    cu_seqlens: tuple[int, ...], tokens: int, device: torch.device
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The segments of a packed row of `tokens` grouped for the parent's causal attention, each group as one padded
    batch `(gather [longest, samples] token indices, keep [real tokens] their places in the flattened batch)`; and
    `order` [tokens]: each packed token's row in the groups' real tokens concatenated (a row past them, zeros, for
    tokens after the last segment). Cached: every layer of a forward pass asks for the same row's.

    Segments shorter than `ALONE_FROM` tokens are grouped by length (those in (2^(j-1), 2^j] together: one call per
    group rather than per sample, each padded at most to twice its length); longer ones, whose quadratic cost
    outweighs a call's overhead, run alone. Positions past a segment's end repeat its last token, which no earlier
    position attends to (causal)."""
    starts, lengths = cu_seqlens[:-1], [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    groups: dict[tuple[int, int], list[int]] = {}
    for j, n in enumerate(lengths):
        key = (max(n - 1, 0).bit_length(), 0) if n < ALONE_FROM else (0, j + 1)
        groups.setdefault(key, []).append(j)
    buckets, scatter = [], []
    for members in groups.values():
        start = torch.tensor([starts[j] for j in members])
        length = torch.tensor([lengths[j] for j in members])
        pos = torch.arange(int(length.max())).unsqueeze(1)  # [longest, 1]
        gather = start + torch.minimum(pos, length - 1)  # [longest, samples]
        real = pos < length
        buckets.append((gather.to(device), real.reshape(-1).nonzero().squeeze(1).to(device)))
        scatter.append(gather[real])
    placed = torch.cat(scatter)
    order = torch.full((tokens,), len(placed))
    order[placed] = torch.arange(len(placed))
    return buckets, order.to(device)


def with_local_core_attention(block_spec: Any, variant: Callable[[type], type]) -> Any:
    """`block_spec` (a `TransformerBlockSubmodules`) with every local core attention class `core` replaced by
    `variant(core)` (`packed_variant`, `sdpa_attention.sdpa_variant`); Transformer Engine attention is kept."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def layer(spec: Any) -> Any:
        attention: Any = getattr(spec.submodules, "self_attention", None)
        sub: Any = getattr(attention, "submodules", None)
        core = getattr(sub, "core_attention", None)
        if not (isinstance(core, type) and issubclass(core, DotProductAttention)):
            return spec
        sub = dataclasses.replace(sub, core_attention=variant(core))
        attention = dataclasses.replace(attention, submodules=sub)
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))

    return dataclasses.replace(block_spec, layer_specs=[layer(s) for s in block_spec.layer_specs])
