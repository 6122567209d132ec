"""Packed (THD) sequences on the local layer spec.

Megatron-Core's local `DotProductAttention` refuses `packed_seq_params` (only Transformer Engine's attention takes
the THD format). Everything around it already handles THD: the attention module squeezes the batch dimension and
applies rotary embeddings per segment from `cu_seqlens`. `with_packed_local_attention` swaps each local core
attention class of a decoder block spec for a subclass that runs the parent's own causal attention once per
segment, so a packed sample is computed exactly as the same sample alone. Transformer Engine's attention is left
as it is (it runs THD natively on the GPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


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
            cu = packed_seq_params.cu_seqlens_q.tolist()
            outputs = [
                super(PackedCoreAttention, self).forward(
                    query[a:b].unsqueeze(1),
                    key[a:b].unsqueeze(1),
                    value[a:b].unsqueeze(1),
                    None,
                    attn_mask_type,
                    attention_bias,
                )  # fmt: skip
                for a, b in zip(cu[:-1], cu[1:], strict=True)
            ]
            return torch.cat(outputs, dim=0)  # [tokens, 1, heads * dim]

    PackedCoreAttention.__name__ = PackedCoreAttention.__qualname__ = f"Packed{cls.__name__}"
    return PackedCoreAttention


def with_packed_local_attention(block_spec: Any) -> Any:
    """`block_spec` (a `TransformerBlockSubmodules`) with every local core attention class replaced by its packed
    variant; Transformer Engine attention is kept."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def layer(spec: Any) -> Any:
        attention: Any = getattr(spec.submodules, "self_attention", None)
        sub: Any = getattr(attention, "submodules", None)
        core = getattr(sub, "core_attention", None)
        if not (isinstance(core, type) and issubclass(core, DotProductAttention)):
            return spec
        sub = dataclasses.replace(sub, core_attention=packed_variant(core))
        attention = dataclasses.replace(attention, submodules=sub)
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))

    return dataclasses.replace(block_spec, layer_specs=[layer(s) for s in block_spec.layer_specs])
