"""The local spec's packed (THD) core attention equals Megatron's own attention run on each sample alone."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.megatron_backend.actor.packing import Packing
from megatron_rl.megatron_backend.layers.packed_attention import ALONE_FROM, packed_variant


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_packed_attention_equals_each_sample_alone(megatron_world, heads: int, groups: int) -> None:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * 8,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=8,
        attention_dropout=0.0,
    )
    plain = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    packed = packed_variant(DotProductAttention)(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    # Short samples of several length groups (two of the same group), one alone (>= ALONE_FROM), padding at the end.
    lengths = [5, 3, 17, ALONE_FROM + 9, 16, 1]
    packing = Packing.of(lengths, multiple=8)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(packing.total, heads, 8, generator=gen, requires_grad=True)
    k = torch.randn(packing.total, groups, 8, generator=gen, requires_grad=True)
    v = torch.randn(packing.total, groups, 8, generator=gen, requires_grad=True)
    out = packed(q, k, v, None, packed_seq_params=packing.seq_params(torch.device("cpu")))
    assert out.shape == (packing.total, heads * 8)  # THD, as Transformer Engine returns it
    cu = packing.cu_seqlens().tolist()
    segments = zip(cu[:-1], cu[1:], strict=True)
    alone = torch.cat([plain(q[a:b].unsqueeze(1), k[a:b].unsqueeze(1), v[a:b].unsqueeze(1), None) for a, b in segments])
    real = packing.used
    torch.testing.assert_close(out[:real], alone[:real, 0], rtol=0, atol=1e-6)
    # Gradients reach each sample's own tokens as in the per-sample computation.
    weights = torch.randn(real, heads * 8, generator=gen)
    (grad_packed,) = torch.autograd.grad((out[:real] * weights).sum(), q)
    (grad_alone,) = torch.autograd.grad((alone[:real, 0] * weights).sum(), q)
    torch.testing.assert_close(grad_packed, grad_alone, rtol=0, atol=1e-5)


def test_packed_attention_refuses_other_formats_and_masks(megatron_world) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, kv_channels=8)
    packed = packed_variant(DotProductAttention)(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="only 'thd'"):
        packed(x, x, x, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="not an attention mask"):
        packed(x, x, x, torch.ones(1, 1, 4, 4, dtype=torch.bool), packed_seq_params=Packing.of([4]).seq_params("cpu"))
