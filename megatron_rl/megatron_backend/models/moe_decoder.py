"""HF <-> Megatron weight rules shared by the pre-norm decoder MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral).

The families differ only in HF module names (`DecoderNames`) and a few options their `ModelDims` carry
(QK-norm, QKV bias, shared expert); the Megatron side is always GPTModel with the local or TE layer spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron_rl.megatron_backend.models.family import (
    HFConfig,
    ModelDims,
    WeightRule,
    merge_qkv_from_hf,
    split_qkv_to_hf,
)


@dataclass(frozen=True)
class DecoderNames:
    """HF names inside `model.layers.{i}.` for one family."""

    moe_block: str = "mlp"  # Mixtral: block_sparse_moe
    router: str = "gate"
    expert_gate: str = "gate_proj"  # Mixtral: w1
    expert_up: str = "up_proj"  # Mixtral: w3
    expert_down: str = "down_proj"  # Mixtral: w2


def cat0(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def split_half(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.chunk(2, dim=0))


def merge_qkv_bias(tensors: list[torch.Tensor], num_heads: int, num_groups: int, head_dim: int) -> torch.Tensor:
    return merge_qkv_from_hf([t.unsqueeze(-1) for t in tensors], num_heads, num_groups, head_dim).squeeze(-1)


def split_qkv_bias(tensor: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> list[torch.Tensor]:
    return [t.squeeze(-1) for t in split_qkv_to_hf(tensor.unsqueeze(-1), num_heads, num_groups, head_dim)]


def _glu(megatron: str, gate: str, up: str) -> WeightRule:
    return WeightRule(megatron, (gate, up), to_megatron=cat0, to_hf=split_half, glu=True)


def decoder_weight_rules(hf: HFConfig, dims: ModelDims, names: DecoderNames) -> list[WeightRule]:
    """Every Megatron parameter of the model and the HF tensors it is built from, in a fixed order."""
    qkv: dict[str, Any] = dict(
        num_heads=dims.num_attention_heads, num_groups=dims.num_query_groups, head_dim=dims.head_dim
    )
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not dims.tie_word_embeddings:
        rules.append(WeightRule("output_layer.weight", ("lm_head.weight",)))
    for layer in range(dims.num_layers):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        rules += [
            WeightRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",)),
            WeightRule(
                m + "self_attention.linear_qkv.weight",
                tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
                to_megatron=partial(merge_qkv_from_hf, **qkv),
                to_hf=partial(split_qkv_to_hf, **qkv),
            ),
            WeightRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",)),
            WeightRule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
        ]
        if dims.qkv_bias:
            rules.append(
                WeightRule(
                    m + "self_attention.linear_qkv.bias",
                    tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"),
                    to_megatron=partial(merge_qkv_bias, **qkv),
                    to_hf=partial(split_qkv_bias, **qkv),
                )
            )
        if dims.qk_layernorm:
            rules += [
                WeightRule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",)),
                WeightRule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",)),
            ]
        if not dims.moe_layer_pattern[layer]:
            rules += [
                _glu(m + "mlp.linear_fc1.weight", h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                WeightRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",)),
            ]
            continue
        block = h + names.moe_block + "."
        rules.append(WeightRule(m + "mlp.router.weight", (block + names.router + ".weight",)))
        for e in range(dims.num_experts):
            me, he = m + f"mlp.experts.local_experts.{e}.", block + f"experts.{e}."
            rules += [
                _glu(me + "linear_fc1.weight", he + names.expert_gate + ".weight", he + names.expert_up + ".weight"),
                WeightRule(me + "linear_fc2.weight", (he + names.expert_down + ".weight",)),
            ]
        if dims.shared_expert_ffn_hidden_size:  # Qwen2-MoE: mlp.shared_expert.* gated by mlp.shared_expert_gate
            ms, hs = m + "mlp.shared_experts.", block + "shared_expert."
            rules += [
                _glu(ms + "linear_fc1.weight", hs + "gate_proj.weight", hs + "up_proj.weight"),
                WeightRule(ms + "linear_fc2.weight", (hs + "down_proj.weight",)),
                WeightRule(ms + "gate_weight", (block + "shared_expert_gate.weight",)),
            ]
    return rules


def moe_layer_pattern(hf: HFConfig) -> tuple[int, ...]:
    """Qwen-style MoE placement: MoE unless in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
    mlp_only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1))
    return tuple(int(i not in mlp_only and (i + 1) % step == 0) for i in range(int(hf["num_hidden_layers"])))


def decoder_transformer_config(hf: HFConfig, dims: ModelDims) -> dict:
    """Megatron `TransformerConfig` kwargs of a pre-norm RMSNorm, RoPE, SwiGLU, softmax-router MoE decoder.

    `dims.renormalize_top_k`: HF softmaxes over all experts and renormalises the top-k (Qwen3 `norm_topk_prob`,
    Mixtral) = Megatron top-k of logits then softmax over them (`moe_router_pre_softmax=False`); without
    renormalisation it is Megatron's `moe_router_pre_softmax=True`.
    """
    import torch.nn.functional as F

    kwargs = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_attention_heads,
        num_query_groups=dims.num_query_groups,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf["rms_norm_eps"]),
        qk_layernorm=dims.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        num_moe_experts=dims.num_experts,
        moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
        moe_router_topk=dims.top_k,
        moe_router_pre_softmax=not dims.renormalize_top_k,
        moe_layer_freq=list(dims.moe_layer_pattern),
        moe_router_dtype="fp32",
    )
    if dims.shared_expert_ffn_hidden_size:
        kwargs.update(
            moe_shared_expert_intermediate_size=dims.shared_expert_ffn_hidden_size, moe_shared_expert_gate=True
        )
    return kwargs


def gpt_model_kwargs(hf: HFConfig, dims: ModelDims, rope_base: float) -> dict:
    return dict(
        max_sequence_length=dims.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_base,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=dims.tie_word_embeddings,
    )
