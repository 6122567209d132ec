"""Mixtral (HF `model_type: mixtral`, e.g. Mixtral-8x7B, 8x22B).

Every layer is MoE (`block_sparse_moe`, experts `w1`=gate, `w3`=up, `w2`=down); the router softmaxes
over all experts and renormalises the top-k, which is Megatron's default post-softmax top-k router.
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
    "num_local_experts",
    "num_experts_per_tok",
    "rms_norm_eps",
)
NAMES = moe_decoder.DecoderNames(
    moe_block="block_sparse_moe", router="gate", expert_gate="w1", expert_up="w3", expert_down="w2"
)


def dims(hf: HFConfig) -> ModelDims:
    require_keys(hf, *REQUIRED_KEYS)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"mixtral with hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    window = hf.get("sliding_window")
    if window and int(window) < int(hf.get("max_position_embeddings", 32768)):
        raise UnsupportedModelError(f"mixtral with sliding_window={window} is not supported (use null)")
    return decoder_dims(
        hf,
        "mixtral",
        default_positions=32768,
        num_experts=int(hf["num_local_experts"]),
        moe_layer_pattern=(1,) * int(hf["num_hidden_layers"]),
        moe_ffn_hidden_size=int(hf["intermediate_size"]),
        renormalize_top_k=True,
    )


def transformer_config_kwargs(hf: HFConfig) -> dict[str, Any]:
    return moe_decoder.decoder_transformer_config(hf, dims(hf))


def gpt_model_kwargs(hf: HFConfig) -> dict[str, Any]:
    return moe_decoder.gpt_model_kwargs(hf, dims(hf), rope_theta(hf))


def mappings(hf: HFConfig) -> list[Mapping]:
    return moe_decoder.decoder_mappings(dims(hf), NAMES)


FAMILY = register_family(
    ModelFamily(
        model_type="mixtral",
        dims=dims,
        transformer_config_kwargs=transformer_config_kwargs,
        gpt_model_kwargs=gpt_model_kwargs,
        mappings=mappings,
        config_keys=frozenset({"num_local_experts", "sliding_window"}),
        supports="every layer MoE, softmax top-k router renormalised",
        hf_architecture="MixtralForCausalLM",
    )
)
