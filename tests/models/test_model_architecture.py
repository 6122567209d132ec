"""The families' `ModelDims` (one owner of the model's architecture facts) and the checkpoint architecture check."""

from __future__ import annotations

import pytest

from megatron_rl.megatron_backend.weights.hf_weights import WeightMismatchError
from megatron_rl.models.architecture import check_same_architecture, is_moe, model_dims
from megatron_rl.models.family import UnsupportedModelError
from megatron_rl.tiny_model import TinyQwen3MoeSpec, hf_config_dict

QWEN2 = dict(
    model_type="qwen2_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3],
    num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
)  # fmt: skip
MIXTRAL = dict(
    model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    rms_norm_eps=1e-5,
)  # fmt: skip


def test_dims_of_each_family_by_hand() -> None:
    q2 = model_dims(QWEN2)
    assert q2.moe_layers == [1, 5]  # every 2nd layer (1, 3, 5) except mlp_only_layers=[3]
    assert (q2.ffn_hidden_size, q2.moe_ffn_hidden_size, q2.shared_expert_ffn_hidden_size) == (96, 32, 48)
    assert (q2.head_dim, q2.qkv_bias, q2.qk_layernorm, q2.renormalize_top_k) == (16, True, False, False)
    mx = model_dims(MIXTRAL)
    assert mx.moe_layers == [0, 1] and (mx.num_experts, mx.ffn_hidden_size, mx.moe_ffn_hidden_size) == (4, 32, 32)
    assert mx.renormalize_top_k and not mx.qkv_bias and not mx.shared_expert_ffn_hidden_size
    q3 = model_dims(hf_config_dict(TinyQwen3MoeSpec(num_hidden_layers=4, mlp_only_layers=(1,))))
    assert q3.moe_layers == [0, 2, 3] and q3.qk_layernorm and not q3.qkv_bias


def test_is_moe_with_full_partial_and_unknown_configs() -> None:
    assert is_moe(QWEN2) and is_moe(MIXTRAL)
    assert is_moe({"model_type": "qwen3_moe", "num_experts": 8})  # keys known before the model is built
    assert is_moe({"model_type": "deepseek_v3", "n_routed_experts": 256})  # no family yet: still MoE
    assert not is_moe({"model_type": "qwen3", "hidden_size": 8})
    assert not is_moe({**MIXTRAL, "num_local_experts": 1})


def test_same_architecture_passes_and_context_length_is_not_architecture() -> None:
    check_same_architecture(QWEN2, dict(QWEN2), "ckpt")
    check_same_architecture(QWEN2, {**QWEN2, "max_position_embeddings": 4096, "rope_theta": 1.0}, "ckpt")


@pytest.mark.parametrize(
    ("expected", "change", "message"),
    [
        (QWEN2, {"num_experts_per_tok": 4}, "num_experts_per_tok=4 but the model was built with num_experts_per_tok=2"),
        (QWEN2, {"model_type": "mixtral"}, "model_type='mixtral' but the model was built with model_type='qwen2_moe'"),
        (QWEN2, {"mlp_only_layers": []}, "moe_layer_pattern=(0, 1, 0, 1, 0, 1) but the model was built with "
                                         "moe_layer_pattern=(0, 1, 0, 0, 0, 1)"),
        (QWEN2, {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 but the model was built "
                                                        "with shared_expert_intermediate_size=48"),
        (QWEN2, {"qkv_bias": False}, "qkv_bias=False but the model was built with qkv_bias=True"),
        (QWEN2, {"norm_topk_prob": True}, "norm_topk_prob=True but the model was built with norm_topk_prob=False"),
        (QWEN2, {"head_dim": 16}, None),  # what transformers derives without the key
        (QWEN2, {"head_dim": 32}, "head_dim=32 but the model was built with head_dim=16"),
        (MIXTRAL, {"num_local_experts": 8}, "num_local_experts=8 but the model was built with num_local_experts=4"),
        (MIXTRAL, {"head_dim": 32}, "head_dim=32 but the model was built with head_dim=16"),
        (MIXTRAL, {"intermediate_size": 64}, "intermediate_size=64 but the model was built with intermediate_size=32"),
        (MIXTRAL, {"tie_word_embeddings": True}, "tie_word_embeddings=True but the model was built with "
                                                 "tie_word_embeddings=False"),
    ],
)  # fmt: skip
def test_another_architecture_is_refused_naming_the_key(expected: dict, change: dict, message: str | None) -> None:
    got = {**expected, **change}
    if message is None:
        check_same_architecture(expected, got, "ckpt")
        return
    with pytest.raises(WeightMismatchError) as err:
        check_same_architecture(expected, got, "ckpt")
    assert str(err.value) == f"ckpt: holds a model with {message}: it is a checkpoint of another architecture"


def test_a_config_its_family_cannot_read_is_a_weight_mismatch() -> None:
    incomplete = {k: v for k, v in QWEN2.items() if k != "moe_intermediate_size"}
    with pytest.raises(WeightMismatchError, match=r"^ckpt: config.json for model_type='qwen2_moe' lacks required"):
        check_same_architecture(QWEN2, incomplete, "ckpt")
    with pytest.raises(UnsupportedModelError, match="supported model types"):
        model_dims({"model_type": "llama"})
