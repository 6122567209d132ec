"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (HF `model_type: glm4_moe`).

Architecture (transformers `modeling_glm4_moe.py`): pre-norm RMSNorm decoder, GQA attention with QKV biases
(`attention_bias`) and optional per-head RMSNorm on queries and keys (`use_qk_norm`, applied before RoPE), partial
rotary embeddings, the first `first_k_dense_replace` layers dense SwiGLU MLPs (`intermediate_size`), the others MoE:
DeepSeek-V3's sigmoid router (`Glm4MoeTopkRouter`: score-correction bias, group-limited top-k, scaling factor;
translated by `routers.sigmoid_router_kwargs`; the bias moves only if model.options.expert_bias_update_rate > 0)
over `n_routed_experts` SwiGLU experts, plus `n_shared_experts` always-on experts fused into one ungated MLP of
width `moe_intermediate_size * n_shared_experts` whose output is added to the routed one. Untied embeddings.

Partial RoPE: transformers rotates the FIRST `int(head_dim * partial_rotary_factor)` dims of each head and passes
the rest through, rotate-half style (not interleaved); `partial_rotary_factor` defaults to 0.5 when config.json
omits it (`Glm4MoeConfig.__post_init__`). That is Megatron's `rotary_percent` with `rotary_interleaved=False`
(`RotaryEmbedding` sizes `inv_freq` by `kv_channels * rotary_percent`, `_apply_rotary_pos_emb_bshd` rotates
`t[..., :rot_dim]`).

MTP: the released checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers stored as DeepSeek-V3's
(`model.layers.{num_hidden_layers + i}.*`, `deepseek_v3.mtp_layers`); transformers does not build them and neither
do we: they are reported as skipped on load and kept by the conversion round trip.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl.models import moe_decoder
from megatron_rl.models.deepseek_v3 import mtp_layers
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
from megatron_rl.models.mapping import GatedMLPMapping, Mapping
from megatron_rl.models.routers import SIGMOID_ROUTER_KEYS, sigmoid_router_kwargs

REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "rms_norm_eps",
)
# transformers' Glm4MoeConfig defaults for the keys a config.json may omit.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def partial_rotary_factor(hf: HFConfig) -> float:
    """The share of each head's dims that RoPE rotates (transformers 5 keeps it in `rope_parameters`)."""
    params = hf.get("rope_parameters") or {}
    if "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))


def _refuse_single_expert(hf: HFConfig) -> None:
    """transformers renormalises even a single chosen expert's gate to 1 (`norm_topk_prob`); Megatron's sigmoid
    router renormalises only when top-k > 1 (moe_utils.topk_routing_with_score_function)."""
    if int(hf["num_experts_per_tok"]) == 1 and hf.get("norm_topk_prob", True):
        raise UnsupportedModelError(
            "glm4_moe with num_experts_per_tok=1 and norm_topk_prob=true is not supported: transformers sets the "
            "single gate to 1, Megatron's sigmoid router keeps the sigmoid score for top-1"
        )


def dims(hf: HFConfig) -> ModelDims:
    require_keys(hf, *REQUIRED_KEYS)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"glm4_moe with hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    factor = partial_rotary_factor(hf)
    rotary_dims = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dims % 2:
        raise UnsupportedModelError(
            f"glm4_moe with partial_rotary_factor={factor} and head_dim={head_dim} rotates {rotary_dims} dims: it "
            "must be an even number between 2 and head_dim"
        )
    _refuse_single_expert(hf)
    sigmoid_router_kwargs(hf)  # its refusals (norm_topk_prob=false, groupings Megatron scores differently)
    shared = int(hf.get("n_shared_experts") or 0)
    if shared < 1:
        raise UnsupportedModelError(
            "glm4_moe with n_shared_experts=0 is not supported: transformers still builds a zero-width shared "
            "expert (Glm4MoeMoE); every released GLM-4.5 checkpoint has n_shared_experts=1"
        )
    layers = int(hf["num_hidden_layers"])
    dense = int(hf.get("first_k_dense_replace", 1))
    return decoder_dims(
        hf,
        "glm4_moe",
        default_positions=131072,
        head_dim=head_dim,
        num_experts=int(hf["n_routed_experts"]),
        moe_layer_pattern=tuple(int(i >= dense) for i in range(layers)),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        shared_expert_ffn_hidden_size=int(hf["moe_intermediate_size"]) * shared,
        qk_layernorm=bool(hf.get("use_qk_norm", False)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        renormalize_top_k=bool(hf.get("norm_topk_prob", True)),
    )


def transformer_config_kwargs(hf: HFConfig) -> dict[str, Any]:
    kwargs = moe_decoder.decoder_transformer_config(hf, dims(hf))
    kwargs.update(sigmoid_router_kwargs(hf), moe_shared_expert_gate=False)  # GLM's shared experts are ungated
    return kwargs


def gpt_model_kwargs(hf: HFConfig) -> dict[str, Any]:
    kwargs = moe_decoder.gpt_model_kwargs(hf, dims(hf), rope_theta(hf))
    kwargs.update(rotary_percent=partial_rotary_factor(hf))
    return kwargs


def mappings(hf: HFConfig) -> list[Mapping]:
    model_dims = dims(hf)
    # The shared decoder's shared-expert mappings are Qwen2-MoE's (gated, `mlp.shared_expert.`): GLM's follow.
    base = moe_decoder.decoder_mappings(
        replace(model_dims, shared_expert_ffn_hidden_size=0), moe_decoder.DecoderNames()
    )
    m, h = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
    return base + [
        Mapping(m + "router.expert_bias", (h + "gate.e_score_correction_bias",), "moe"),
        GatedMLPMapping(
            m + "shared_experts.linear_fc1.weight",
            (h + "shared_experts.gate_proj.weight", h + "shared_experts.up_proj.weight"),
            "moe",
        ),
        Mapping(m + "shared_experts.linear_fc2.weight", (h + "shared_experts.down_proj.weight",), "moe"),
    ]


FAMILY = register_family(
    ModelFamily(
        model_type="glm4_moe",
        hf_architecture="Glm4MoeForCausalLM",
        dims=dims,
        transformer_config_kwargs=transformer_config_kwargs,
        gpt_model_kwargs=gpt_model_kwargs,
        mappings=mappings,
        config_keys=SIGMOID_ROUTER_KEYS
        | {
            "attention_bias",
            "first_k_dense_replace",
            "moe_intermediate_size",
            "n_shared_experts",
            "num_nextn_predict_layers",
            "partial_rotary_factor",
            "use_qk_norm",
        },
        unused_hf_tensors=mtp_layers,
        supports="partial RoPE, QKV bias, optional QK-norm, sigmoid router with expert bias and group-limited "
        "top-k, ungated shared experts, dense first layers; MTP layers skipped",
    )
)
