"""Qwen3-MoE (HF `model_type: qwen3_moe`, e.g. Qwen3-30B-A3B, Qwen3-235B-A22B).

Architecture (transformers `modeling_qwen3_moe.py`): pre-norm RMSNorm decoder, GQA attention with
per-head RMSNorm on queries and keys (QK-norm), RoPE, SwiGLU experts, softmax top-k router with
optional renormalisation of the selected probabilities (`norm_topk_prob`), optional dense layers
(`mlp_only_layers`, `decoder_sparse_step`), untied or tied embeddings.

Router equivalence: HF computes softmax over all experts, takes the top-k and (if `norm_topk_prob`)
renormalises; Megatron's `moe_router_pre_softmax=False` takes top-k of the logits and softmaxes over
those k, which is the same distribution; `norm_topk_prob=False` maps to `moe_router_pre_softmax=True`.
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
from megatron_rl.models.moe_decoder import (
    DecoderNames,
    decoder_mappings,
    decoder_transformer_config,
    moe_layer_pattern,
)

REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "rms_norm_eps",
)


def _num_experts(hf: HFConfig) -> int:
    value = hf.get("num_experts", hf.get("num_local_experts"))
    if not value:
        raise UnsupportedModelError("qwen3_moe config has no num_experts (or num_local_experts) > 0")
    return int(value)


def dims(hf: HFConfig) -> ModelDims:
    require_keys(hf, *REQUIRED_KEYS)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"qwen3_moe with hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    moe_decoder.refuse_sliding_layers(hf)
    return decoder_dims(
        hf,
        "qwen3_moe",
        default_positions=32768,
        num_experts=_num_experts(hf),
        moe_layer_pattern=moe_layer_pattern(hf),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        qk_layernorm=True,
        qkv_bias=bool(hf.get("attention_bias", False)),
        renormalize_top_k=bool(hf.get("norm_topk_prob", False)),
    )


def transformer_config_kwargs(hf: HFConfig) -> dict[str, Any]:
    return decoder_transformer_config(hf, dims(hf))


def gpt_model_kwargs(hf: HFConfig) -> dict[str, Any]:
    return moe_decoder.gpt_model_kwargs(hf, dims(hf), rope_theta(hf))


def mappings(hf: HFConfig) -> list[Mapping]:
    return decoder_mappings(dims(hf), DecoderNames())


FAMILY = register_family(
    ModelFamily(
        model_type="qwen3_moe",
        dims=dims,
        transformer_config_kwargs=transformer_config_kwargs,
        gpt_model_kwargs=gpt_model_kwargs,
        mappings=mappings,
        config_keys=frozenset(
            {
                "attention_bias",
                "decoder_sparse_step",
                "mlp_only_layers",
                "moe_intermediate_size",
                "norm_topk_prob",
                "num_experts",
                "num_local_experts",
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "layer_types",
            }
        ),
        supports="QK-norm, softmax top-k router (norm_topk_prob), dense layers (mlp_only_layers), tied embeddings",
        hf_architecture="Qwen3MoeForCausalLM",
    )
)
