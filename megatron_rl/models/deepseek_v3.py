"""DeepSeek-V3 (HF `model_type: deepseek_v3`: DeepSeek-V3/R1, Kimi-K2, Moonlight-16B-A3B).

Architecture (transformers `modeling_deepseek_v3.py`): pre-norm RMSNorm decoder with Multi-Latent Attention
(`mla.py`; with or without a query latent, `q_lora_rank` None for Moonlight), RoPE or YaRN; the first
`first_k_dense_replace` layers have a dense SwiGLU MLP, the others `n_routed_experts` SwiGLU experts chosen by a
sigmoid router with a score-correction bias and group-limited top-k (`routers.py`), plus `n_shared_experts`
always-on experts (one ungated MLP of n_shared_experts * moe_intermediate_size).

Multi-token-prediction layers (`model.layers.{num_hidden_layers}...`, `num_nextn_predict_layers`) are not part of
the causal LM transformers builds; checkpoints that carry them load with them skipped and keep them on conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.models import mla, moe_decoder, routers
from megatron_rl.models.family import (
    HFConfig,
    ModelDims,
    ModelFamily,
    UnsupportedModelError,
    decoder_dims,
    register_family,
    require_keys,
)
from megatron_rl.models.mapping import GatedMLPMapping, Mapping

REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rms_norm_eps",
)
# Keys of the original DeepSeek config.json that transformers does not read; accepted only with the values
# transformers' model computes (anything else would be another model served under the same name).
_FIXED_VALUES = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def moe_layer_pattern(hf: HFConfig) -> tuple[int, ...]:
    """Dense for the first `first_k_dense_replace` layers, MoE after."""
    dense = int(hf.get("first_k_dense_replace") or 0)
    return tuple(int(i >= dense) for i in range(int(hf["num_hidden_layers"])))


def dims(hf: HFConfig) -> ModelDims:
    require_keys(hf, *REQUIRED_KEYS)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"deepseek_v3 with hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    for key, value in _FIXED_VALUES.items():
        if key in hf and hf[key] != value:
            raise UnsupportedModelError(
                f"deepseek_v3 with {key}={hf[key]!r}: transformers' DeepSeek-V3 (and this project) compute "
                f"{key}={value!r}; another value describes a different model"
            )
    mla.refuse_unsupported_mla(hf)
    routers.grouped_top_k(hf)
    heads = int(hf["num_attention_heads"])
    rope = int(hf["qk_rope_head_dim"])
    return decoder_dims(
        hf,
        "deepseek_v3",
        default_positions=4096,
        num_query_groups=heads,  # MLA: one key and value per head, expanded from the shared latent
        head_dim=int(hf["qk_nope_head_dim"]) + rope,  # a query's / key's width
        num_experts=int(hf["n_routed_experts"]),
        moe_layer_pattern=moe_layer_pattern(hf),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        renormalize_top_k=bool(hf.get("norm_topk_prob", True)),
        shared_expert_ffn_hidden_size=int(hf["moe_intermediate_size"]) * int(hf.get("n_shared_experts") or 0),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        qk_rope_head_dim=rope,
        v_head_dim=int(hf["v_head_dim"]),
    )


def transformer_config_kwargs(hf: HFConfig) -> dict[str, Any]:
    d = dims(hf)
    kwargs = moe_decoder.decoder_transformer_config(hf, d)
    kwargs.update(mla.mla_config_kwargs(hf, d), **routers.sigmoid_router_kwargs(hf))
    kwargs.update(moe_shared_expert_gate=False)  # DeepSeek's shared experts are added ungated
    return kwargs


def gpt_model_kwargs(hf: HFConfig) -> dict[str, Any]:
    d = dims(hf)
    return dict(
        max_sequence_length=d.max_position_embeddings,
        position_embedding_type="none",  # MLA applies its own RoPE / YaRN
        share_embeddings_and_output_weights=d.tie_word_embeddings,
    )


def mappings(hf: HFConfig) -> list[Mapping]:
    """The shared pre-norm decoder's embeddings, norms, dense MLPs, router and experts (its GQA attention left
    out), MLA's attention, the router's score-correction bias and the ungated shared experts."""
    d = dims(hf)
    decoder = moe_decoder.decoder_mappings(
        dataclasses.replace(d, shared_expert_ffn_hidden_size=0), moe_decoder.DecoderNames()
    )
    out = [m for m in decoder if ".self_attention." not in m.megatron] + mla.mla_mappings(d)
    m, h = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
    out.append(Mapping(m + "router.expert_bias", (h + "gate.e_score_correction_bias",), "moe"))
    if d.shared_expert_ffn_hidden_size:
        s, hs = m + "shared_experts.", h + "shared_experts."
        out += [
            GatedMLPMapping(s + "linear_fc1.weight", (hs + "gate_proj.weight", hs + "up_proj.weight"), "moe"),
            Mapping(s + "linear_fc2.weight", (hs + "down_proj.weight",), "moe"),
        ]
    return out


def mtp_layers(hf: HFConfig) -> tuple[tuple[str, str], ...]:
    """The multi-token-prediction layers' tensors (numbered from num_hidden_layers), which the model does not use."""
    first, count = int(hf["num_hidden_layers"]), int(hf.get("num_nextn_predict_layers") or 0)
    why = "multi-token prediction layer: not part of the causal LM transformers builds"
    return tuple((rf"model\.layers\.{first + i}\..+", why) for i in range(count))


FAMILY = register_family(
    ModelFamily(
        model_type="deepseek_v3",
        hf_architecture="DeepseekV3ForCausalLM",
        dims=dims,
        transformer_config_kwargs=transformer_config_kwargs,
        gpt_model_kwargs=gpt_model_kwargs,
        mappings=mappings,
        config_keys=mla.MLA_KEYS
        | routers.SIGMOID_ROUTER_KEYS
        | frozenset(
            {
                "moe_intermediate_size",
                "n_shared_experts",
                "first_k_dense_replace",
                "num_nextn_predict_layers",
                "num_mtp_layers",
                "scoring_func",
                "topk_method",
                "moe_layer_freq",
                # training-time only: the auxiliary balance loss and the deployment's expert-parallel size
                "aux_loss_alpha",
                "seq_aux",
                "ep_size",
            }
        ),
        config_class="mla",
        layer_spec="mla",
        unused_hf_tensors=mtp_layers,
        supports="Multi-Latent Attention (with/without q_lora), YaRN, sigmoid router with score-correction bias and "
        "group-limited top-k, shared experts, dense first layers (also Kimi-K2, Moonlight)",
    )
)
