"""Qwen2-MoE (HF `model_type: qwen2_moe`, e.g. Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Like Qwen3-MoE but with QKV biases, no QK-norm, and a shared expert whose output is scaled by a
sigmoid gate (`mlp.shared_expert_gate`), which is Megatron's `moe_shared_expert_gate`.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models import moe_decoder
from megatron_rl.models.family import (
    HFConfig,
    ModelDims,
    ModelFamily,
    UnsupportedModelError,
    decoder_dims,
    register_family,
    require_keys,
    rope_theta,
)
from megatron_rl.models.mapping import Mapping

REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "rms_norm_eps",
)


def dims(hf: HFConfig) -> ModelDims:
    require_keys(hf, *REQUIRED_KEYS)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"qwen2_moe with hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    moe_decoder.refuse_sliding_layers(hf)
    return decoder_dims(
        hf,
        "qwen2_moe",
        default_positions=32768,
        num_experts=int(hf["num_experts"]),
        moe_layer_pattern=moe_decoder.moe_layer_pattern(hf),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        shared_expert_ffn_hidden_size=int(hf.get("shared_expert_intermediate_size") or 0),
        qkv_bias=bool(hf.get("qkv_bias", True)),
        renormalize_top_k=bool(hf.get("norm_topk_prob", False)),
    )


def transformer_config_kwargs(hf: HFConfig) -> dict[str, Any]:
    return moe_decoder.decoder_transformer_config(hf, dims(hf))


def gpt_model_kwargs(hf: HFConfig) -> dict[str, Any]:
    return moe_decoder.gpt_model_kwargs(hf, dims(hf), rope_theta(hf))


def mappings(hf: HFConfig) -> list[Mapping]:
    return moe_decoder.decoder_mappings(dims(hf), moe_decoder.DecoderNames())


FAMILY = register_family(
    ModelFamily(
        model_type="qwen2_moe",
        dims=dims,
        transformer_config_kwargs=transformer_config_kwargs,
        gpt_model_kwargs=gpt_model_kwargs,
        mappings=mappings,
        config_keys=frozenset(
            {
                "qkv_bias",
                "decoder_sparse_step",
                "mlp_only_layers",
                "moe_intermediate_size",
                "norm_topk_prob",
                "num_experts",
                "shared_expert_intermediate_size",
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "layer_types",
            }
        ),
        supports="QKV bias, sigmoid-gated shared expert, softmax router, dense layers, tied embeddings",
        hf_architecture="Qwen2MoeForCausalLM",
    )
)
