"""The local spec's SDPA core attention equals Megatron's unfused `DotProductAttention` (fp32, forward and
gradients): causal, grouped-query, an explicit mask with a fully masked row, a decode step, query-key layer
scaling, MLA's value width, packed (THD) rows, attention sinks and sliding windows, dropout only while training;
and a tiny Qwen3-MoE's log-probs and entropies (padded and packed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.megatron_backend.actor.packing import Packing
from megatron_rl.megatron_backend.layers.packed_attention import packed_variant
from megatron_rl.megatron_backend.layers.sdpa_attention import sdpa_variant


def _config(heads: int, groups: int, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=heads * 8, num_attention_heads=heads, num_query_groups=groups, kv_channels=8,
        **{"attention_dropout": 0.0, **kw},
    )  # fmt: skip


def _pair(cls: type, config, *, layer: int = 1, causal: bool = True, **kw) -> tuple[Any, Any]:
    """(unfused, SDPA) core attention modules of class `cls` built alike (same parameters, if any)."""
    from megatron.core.transformer.enums import AttnMaskType

    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    made = [c(config, layer_number=layer, attn_mask_type=mask_type, attention_type="self", **kw)
            for c in (cls, sdpa_variant(cls))]  # fmt: skip
    made[1].load_state_dict(made[0].state_dict())
    return made[0], made[1]


def _qkv(sq: int, b: int, heads: int, groups: int, dim: int = 8, v_dim: int = 8, sk: int | None = None):
    gen = torch.Generator().manual_seed(sq * 31 + heads)
    sk = sq if sk is None else sk
    return (
        torch.randn(sq, b, heads, dim, generator=gen, requires_grad=True),
        torch.randn(sk, b, groups, dim, generator=gen, requires_grad=True),
        torch.randn(sk, b, groups, v_dim, generator=gen, requires_grad=True),
    )


def _assert_same(unfused, sdpa, qkv, mask=None, **kw) -> None:
    """Outputs within 1e-6 and gradients of q, k, v within 1e-5."""
    outs = [m(*qkv, mask, **kw) for m in (unfused, sdpa)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)
    weights = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(1))
    grads = [torch.autograd.grad((o * weights).sum(), qkv) for o in outs]
    for g_sdpa, g_unfused in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_sdpa, g_unfused, rtol=0, atol=1e-5)


@pytest.mark.parametrize("heads,groups,sq", [(4, 4, 13), (4, 2, 13), (8, 2, 1)])
def test_causal_and_grouped_query_attention(megatron_world, heads: int, groups: int, sq: int) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    _assert_same(*_pair(DotProductAttention, _config(heads, groups)), _qkv(sq, 3, heads, groups))


def test_explicit_mask_replaces_causal_and_fully_masked_rows_average(megatron_world) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    sq, b = 9, 3
    pad = torch.zeros(b, 1, sq, sq, dtype=torch.bool)
    pad[1, :, :, 6:] = True  # keys past a length of 6
    pad[2, :, 2, :] = True  # a fully masked row: the parent softmaxes -10000s uniformly
    for causal in (True, False):
        pair = _pair(DotProductAttention, _config(4, 2), causal=causal)
        _assert_same(*pair, _qkv(sq, b, 4, 2), pad)
        _assert_same(*pair, _qkv(sq, b, 4, 2), pad[:1].expand(1, 4, sq, sq))  # one mask for the batch, per head


def test_query_key_layer_scaling_and_custom_softmax_scale(megatron_world) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    config = _config(4, 2, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True)
    _assert_same(*_pair(DotProductAttention, config, layer=3, softmax_scale=0.37), _qkv(11, 2, 4, 2))


def test_mla_value_width_and_thd_padded_value(megatron_world) -> None:
    from megatron_rl.megatron_backend.layers.mla import _local_mla_classes

    mla_core = _local_mla_classes()[1]
    unfused, sdpa = _pair(mla_core, _config(4, 4), k_channels=8, v_channels=6, softmax_scale=0.29)
    _assert_same(unfused, sdpa, _qkv(10, 2, 4, 4, v_dim=6))
    pad = torch.zeros(2, 1, 10, 10, dtype=torch.bool)
    pad[1, :, :, 6:] = True
    pad[1, :, 3, :] = True
    _assert_same(unfused, sdpa, _qkv(10, 2, 4, 4, v_dim=6), pad)
    for m in (unfused, sdpa):  # 0.19.x's MLA widens the value to the query width for THD, then trims
        m.hidden_size_per_attention_head_v = 8
    _assert_same(unfused, sdpa, _qkv(10, 2, 4, 4, v_dim=8))


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_packed_rows(megatron_world, heads: int, groups: int) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(heads, groups)
    unfused, sdpa = (
        packed_variant(c)(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        for c in (DotProductAttention, sdpa_variant(DotProductAttention))
    )
    packing = Packing.of([5, 3, 17, 140, 16, 1], multiple=8)
    q, k, v = (t.squeeze(1) for t in _qkv(packing.total, 1, heads, groups))
    params = packing.seq_params(torch.device("cpu"))
    _assert_same(unfused, sdpa, (q, k, v), packed_seq_params=params)
    # cu_seqlens that stop before the row's end (no padding segment): the tokens after it get zeros
    cu = params.cu_seqlens_q[:-1]
    short = dataclasses.replace(params, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out, full = (sdpa(q, k, v, None, packed_seq_params=x) for x in (short, params))
    assert packing.total > packing.used and not out[packing.used :].any()
    torch.testing.assert_close(out[: packing.used], full[: packing.used], rtol=0, atol=0)


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one", "vanilla"])
def test_sinks_and_sliding_windows(megatron_world, softmax_type: str) -> None:
    """GPT-OSS's attention: a sink logit per head (SoftmaxOne) and a window on every other layer."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    config = _config(4, 2, softmax_type=softmax_type, window_size=(3, 0), window_attn_skip_freq=2)
    pad = torch.zeros(2, 1, 12, 12, dtype=torch.bool)
    pad[1, :, :, 7:] = True
    pad[1, :, 4, :] = True  # with a sink the row's weight all goes to the sink: 0
    for layer in (1, 2):  # windowed and full layers
        unfused, sdpa = _pair(DotProductAttention, config, layer=layer)
        if softmax_type == "learnable":
            torch.nn.init.normal_(unfused.softmax_offset)
            sdpa.load_state_dict(unfused.state_dict())
        elif softmax_type == "off-by-one":  # Megatron makes these zeros on `torch.cuda.current_device()`
            unfused.softmax_offset = sdpa.softmax_offset = torch.zeros(4)
        for mask in (None, pad):
            _assert_same(unfused, sdpa, _qkv(12, 2, 4, 2), mask)
        if softmax_type == "learnable":  # the sinks' gradients
            grads = []
            for m in (unfused, sdpa):
                out = m(*_qkv(12, 2, 4, 2), None)
                (grad,) = torch.autograd.grad(
                    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), m.softmax_offset
                )
                grads.append(grad)
            torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)


def test_tiny_qwen3_moe_log_probs_sdpa_vs_unfused(megatron_world, tiny_moe_dir: Path) -> None:
    from megatron_rl.config.options import ModelOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.parallel_layout import ParallelLayout

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 100, (6, 24), generator=gen)
    lengths = torch.tensor([24, 10, 17, 24, 5, 12])
    batch = TokenBatch(ids, lengths, torch.full((6,), 3))
    scores = {}
    for attention in ("unfused", "sdpa"):
        for packing in (False, True):
            actor = MegatronActor.from_hf(
                tiny_moe_dir, ParallelLayout(), micro_batch_tokens=64,
                model_options=ModelOptions(local_attention=attention, packing=packing),
            )  # fmt: skip
            scores[attention, packing] = actor.compute_log_probs(batch, with_entropy=True)
    for packing in (False, True):
        base, new = scores["unfused", packing], scores["sdpa", packing]
        torch.testing.assert_close(new.log_probs, base.log_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(new.entropy, base.entropy, rtol=0, atol=1e-5)


def test_attention_dropout_only_while_training(megatron_world) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    unfused, sdpa = _pair(DotProductAttention, _config(4, 2, attention_dropout=0.5))
    qkv = _qkv(12, 2, 4, 2)
    unfused.eval()
    sdpa.eval()
    _assert_same(unfused, sdpa, qkv)
    sdpa.train()
    dropped = sdpa(*qkv, None)
    assert not torch.allclose(dropped, sdpa.eval()(*qkv, None))  # some probabilities dropped (and the rest scaled)


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_scoring_and_training_forward_are_bitwise_equal(megatron_world, softmax_type: str) -> None:
    """The first update's ppo_kl is exactly 0 only if the no-grad (scoring) and grad (training) forwards agree
    bitwise: SDPA must not pick a different kernel when the inputs or the sinks need gradients."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(4, 2, softmax_type=softmax_type, window_size=(3, 0), window_attn_skip_freq=2)
    for layer in (1, 2):
        sdpa = sdpa_variant(DotProductAttention)(config, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                                                 attention_type="self")  # fmt: skip
        qkv = _qkv(12, 2, 4, 2)
        with torch.no_grad():
            scored = sdpa(*qkv, None)
        assert torch.equal(sdpa(*qkv, None), scored)
