"""The declarative family registry: wildcard mappings resolved lazily, fused expert tensors, config-field refusal.

No Megatron here: mappings and the weight map are pure tensor code; the families' Megatron paths are checked by
tests/models/test_<family>.py and the actor/conversion tests (tests/megatron_backend/).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import UnsupportedModelError, get_family, supported_families
from megatron_rl.models.mapping import (
    GatedMLPMapping,
    Mapping,
    QKVMapping,
    WeightMap,
    canonical_name,
)

QWEN3_235B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
    "mlp_only_layers": [], "decoder_sparse_step": 1, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 94, "attention_bias": False, "torch_dtype": "bfloat16",
}  # fmt: skip


@pytest.mark.parametrize("model_type", [f.model_type for f in supported_families()])
def test_transformers_default_config_of_each_family_is_understood(model_type: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    family = get_family(config)  # every field transformers writes is translated or known not to change the math
    assert family.model_type == model_type


def test_an_unknown_config_field_is_refused_by_name() -> None:
    with pytest.raises(
        UnsupportedModelError, match=r"fields this project does not translate: \['attn_logit_softcap'\]"
    ):
        get_family({**QWEN3_235B, "attn_logit_softcap": 30.0})
    with pytest.raises(UnsupportedModelError, match=r"model_type='llama'.*supported model types"):
        get_family({"model_type": "llama"})


def test_rules_resolve_lazily_by_wildcard() -> None:
    weights = get_family(QWEN3_235B).weight_map(QWEN3_235B)
    rule = weights.rule("decoder.layers.93.mlp.experts.local_experts.127.linear_fc1.weight")
    assert rule is not None and rule.glu and rule.expert_slot is None
    assert rule.hf == (
        "model.layers.93.mlp.experts.127.gate_proj.weight",
        "model.layers.93.mlp.experts.127.up_proj.weight",
    )
    assert weights.rule("decoder.layers.94.input_layernorm.weight") is None  # no layer 94
    assert weights.rule("decoder.layers.0.mlp.experts.local_experts.128.linear_fc2.weight") is None  # 128 experts
    assert weights.rule("decoder.layers.0.mlp.linear_fc1.weight") is None  # every layer is MoE
    assert weights.rule("embedding.word_embeddings.weight").vocab_padded
    assert weights._hf_names is None  # nothing expanded until the whole name list is asked for
    # Per layer: 2 norms, qkv, proj, 2 QK-norms, router, 128 x (fc1, fc2); plus embedding, final norm, head.
    assert sum(1 for _ in weights.rules()) == 94 * (7 + 2 * 128) + 3
    assert get_family(QWEN3_235B).weight_map(QWEN3_235B) is weights  # built once per config


def test_transformer_engine_names_translate_to_local_names() -> None:
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.3.input_layernorm.weight"
    )
    assert (
        canonical_name("decoder.layers.3.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.3.pre_mlp_layernorm.weight"
    )
    assert canonical_name("decoder.layers.3.self_attention.linear_kv_up_proj.layer_norm_weight") == (
        "decoder.layers.3.self_attention.kv_layernorm.weight"
    )


def test_qkv_mapping_groups_queries_with_their_key_and_value() -> None:
    mapping = QKVMapping("qkv", ("q", "k", "v"), heads=4, groups=2, head_dim=3)
    q, k, v = (
        torch.arange(12 * 5.0).view(12, 5),
        -torch.arange(6 * 5.0).view(6, 5),
        100 + torch.arange(6 * 5.0).view(6, 5),
    )
    merged = mapping.to_megatron([q, k, v])
    # group 0: query heads 0-1, key head 0, value head 0; then group 1
    assert torch.equal(merged[:6], q[:6]) and torch.equal(merged[6:9], k[:3]) and torch.equal(merged[9:12], v[:3])
    assert torch.equal(merged[12:18], q[6:]) and torch.equal(merged[18:21], k[3:])
    assert all(torch.equal(a, b) for a, b in zip(mapping.to_hf(merged), [q, k, v], strict=True))
    bias = [q[:, 0], k[:, 0], v[:, 0]]
    assert torch.equal(mapping.to_megatron(bias), merged[:, 0])
    assert all(torch.equal(a, b) for a, b in zip(mapping.to_hf(merged[:, 0]), bias, strict=True))


class _TransposedExperts(Mapping):
    """A fused HF expert tensor stored [E, in, out] (Megatron keeps [out, in] per expert)."""

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0].t()

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.t()]


def test_fused_expert_tensor_is_read_per_expert_and_reassembled_in_any_order() -> None:
    m = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight"
    mapping = _TransposedExperts(m, ("model.layers.{layer}.mlp.experts.down_proj",), "moe")
    weights = WeightMap([mapping], moe_layer_pattern=(0, 1), num_experts=3)
    fused = torch.randn(3, 4, 5)  # [E, in, out]
    rules = list(weights.rules())
    assert [r.megatron for r in rules] == [m.format(layer=1, expert=e) for e in range(3)]  # layer 0 is dense
    assert all(r.hf == ("model.layers.1.mlp.experts.down_proj",) for r in rules)
    built = [weights.build(r, lambda name, slot: fused[slot]) for r in rules]
    assert all(torch.equal(b, fused[e].t()) for e, b in enumerate(built))
    builder = weights.hf_tensor_builder(vocab_size=0)
    assert builder.add(rules[2], built[2]) == [] and builder.add(rules[0], built[0]) == []
    with pytest.raises(RuntimeError, match="got 2 of 3 experts"):
        builder.check_finished()
    ((name, tensor),) = builder.add(rules[1], built[1])
    assert name == "model.layers.1.mlp.experts.down_proj" and torch.equal(tensor, fused)
    builder.check_finished()


def test_vocab_padding_is_a_property_of_the_mapping() -> None:
    embedding = Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab_padded=True)
    fc1 = GatedMLPMapping("decoder.layers.{layer}.mlp.linear_fc1.weight", ("g", "u"))
    weights = WeightMap([embedding, fc1], moe_layer_pattern=(0,), num_experts=0, tie_word_embeddings=True)
    table = torch.randn(5, 2)
    padded = weights.build(weights.rule("embedding.word_embeddings.weight"), lambda n, s: table, rows=8)
    assert padded.shape == (8, 2) and torch.equal(padded[:5], table) and not padded[5:].any()
    head = weights.rule("output_layer.weight")  # tied: the last stage's copy reads the embedding
    assert head is not None and head.hf == ("model.embed_tokens.weight",)
    assert [r.megatron for r in weights.rules()] == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
    ]
    ((name, cut),) = weights.hf_tensor_builder(vocab_size=5).add(
        weights.rule("embedding.word_embeddings.weight"), padded
    )
    assert name == "model.embed_tokens.weight" and torch.equal(cut, table)
