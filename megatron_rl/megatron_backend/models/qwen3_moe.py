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

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl.megatron_backend.models.family import (
    HFConfig,
    ModelDims,
    ModelFamily,
    UnsupportedModelError,
    WeightRule,
    merge_qkv_from_hf,
    register_family,
    require_keys,
    rope_theta,
    split_qkv_to_hf,
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


def moe_layer_pattern(hf: HFConfig) -> tuple[int, ...]:
    """1 for MoE layers, 0 for dense ones, as `Qwen3MoeDecoderLayer.__init__` decides."""
    mlp_only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1))
    return tuple(int(i not in mlp_only and (i + 1) % step == 0) for i in range(int(hf["num_hidden_layers"])))


def dims(hf: HFConfig) -> ModelDims:
    require_keys(hf, *REQUIRED_KEYS)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"qwen3_moe with hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError("qwen3_moe with use_sliding_window=true is not supported")
    heads = int(hf["num_attention_heads"])
    groups = int(hf["num_key_value_heads"])
    if heads % groups:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    return ModelDims(
        model_type="qwen3_moe",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_experts=_num_experts(hf),
        top_k=int(hf["num_experts_per_tok"]),
        moe_layer_pattern=moe_layer_pattern(hf),
    )


def transformer_config_kwargs(hf: HFConfig) -> dict[str, Any]:
    d = dims(hf)
    return dict(
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        num_attention_heads=d.num_attention_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.head_dim,
        ffn_hidden_size=int(hf["intermediate_size"]),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf["rms_norm_eps"]),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        num_moe_experts=d.num_experts,
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_router_topk=d.top_k,
        moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
        moe_layer_freq=list(d.moe_layer_pattern),
        moe_router_dtype="fp32",
    )


def gpt_model_kwargs(hf: HFConfig) -> dict[str, Any]:
    d = dims(hf)
    return dict(
        max_sequence_length=d.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
        rotary_percent=1.0,
        share_embeddings_and_output_weights=d.tie_word_embeddings,
    )


def weight_rules(hf: HFConfig) -> list[WeightRule]:
    d = dims(hf)
    qkv = dict(num_heads=d.num_attention_heads, num_groups=d.num_query_groups, head_dim=d.head_dim)
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not d.tie_word_embeddings:
        rules.append(WeightRule("output_layer.weight", ("lm_head.weight",)))
    for layer in range(d.num_layers):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        rules += [
            WeightRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",)),
            WeightRule(
                m + "self_attention.linear_qkv.weight",
                tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
                to_megatron=partial(merge_qkv_from_hf, **qkv),
                to_hf=partial(split_qkv_to_hf, **qkv),
            ),
            WeightRule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",)),
            WeightRule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",)),
            WeightRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",)),
            WeightRule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
        ]
        if hf.get("attention_bias", False):
            rules.append(
                WeightRule(
                    m + "self_attention.linear_qkv.bias",
                    tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"),
                    to_megatron=partial(_merge_qkv_bias, **qkv),
                    to_hf=partial(_split_qkv_bias, **qkv),
                )
            )
        if d.moe_layer_pattern[layer]:
            rules.append(WeightRule(m + "mlp.router.weight", (h + "mlp.gate.weight",)))
            for e in range(d.num_experts):
                me, he = m + f"mlp.experts.local_experts.{e}.", h + f"mlp.experts.{e}."
                rules += [
                    WeightRule(
                        me + "linear_fc1.weight",
                        (he + "gate_proj.weight", he + "up_proj.weight"),
                        to_megatron=_cat0,
                        to_hf=_split_half,
                        glu=True,
                    ),
                    WeightRule(me + "linear_fc2.weight", (he + "down_proj.weight",)),
                ]
        else:
            rules += [
                WeightRule(
                    m + "mlp.linear_fc1.weight",
                    (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                    to_megatron=_cat0,
                    to_hf=_split_half,
                    glu=True,
                ),
                WeightRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",)),
            ]
    return rules


def _cat0(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _split_half(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.chunk(2, dim=0))


def _merge_qkv_bias(tensors, num_heads, num_groups, head_dim):
    return merge_qkv_from_hf([t.unsqueeze(-1) for t in tensors], num_heads, num_groups, head_dim).squeeze(-1)


def _split_qkv_bias(tensor, num_heads, num_groups, head_dim):
    return [t.squeeze(-1) for t in split_qkv_to_hf(tensor.unsqueeze(-1), num_heads, num_groups, head_dim)]


FAMILY = register_family(
    ModelFamily(
        model_type="qwen3_moe",
        dims=dims,
        transformer_config_kwargs=transformer_config_kwargs,
        gpt_model_kwargs=gpt_model_kwargs,
        weight_rules=weight_rules,
        hf_architecture="Qwen3MoeForCausalLM",
    )
)
