"""Weight mappings and Megatron config shared by the pre-norm decoder MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral).

The families differ only in HF module names (`DecoderNames`) and a few options their `ModelDims` carry
(QK-norm, QKV bias, shared expert); the Megatron side is always GPTModel with the local or TE layer spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.models.family import HFConfig, ModelDims, UnsupportedModelError
from megatron_rl.models.mapping import GatedMLPMapping, Mapping, QKVMapping


@dataclass(frozen=True)
class DecoderNames:
    """HF names inside `model.layers.{i}.` for one family."""

    moe_block: str = "mlp"  # Mixtral: block_sparse_moe
    router: str = "gate"
    expert_gate: str = "gate_proj"  # Mixtral: w1
    expert_up: str = "up_proj"  # Mixtral: w3
    expert_down: str = "down_proj"  # Mixtral: w2


def _qkv(prefix: str, kind: str) -> tuple[str, ...]:
    return tuple(f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv")


def _qkv_mapping(dims: ModelDims, megatron: str, hf: tuple[str, ...]) -> QKVMapping:
    return QKVMapping(
        megatron, hf, heads=dims.num_attention_heads, groups=dims.num_query_groups, head_dim=dims.head_dim
    )


def decoder_mappings(dims: ModelDims, names: DecoderNames) -> list[Mapping]:
    """The weight mappings of a pre-norm GQA decoder with SwiGLU experts (and dense layers where the pattern says)."""
    m, h = "decoder.layers.{layer}.", "model.layers.{layer}."
    mappings = [
        Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab_padded=True),
        Mapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Mapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",)),
        _qkv_mapping(dims, m + "self_attention.linear_qkv.weight", _qkv(h, "weight")),
        Mapping(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",)),
        Mapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
        GatedMLPMapping(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "dense"),
        Mapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "dense"),
    ]
    if not dims.tie_word_embeddings:
        mappings.insert(2, Mapping("output_layer.weight", ("lm_head.weight",), vocab_padded=True))
    if dims.qkv_bias:
        mappings.append(_qkv_mapping(dims, m + "self_attention.linear_qkv.bias", _qkv(h, "bias")))
    if dims.qk_layernorm:
        mappings += [
            Mapping(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",)),
            Mapping(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",)),
        ]
    block = h + names.moe_block + "."
    me, he = m + "mlp.experts.local_experts.{expert}.", block + "experts.{expert}."
    mappings += [
        Mapping(m + "mlp.router.weight", (block + names.router + ".weight",), "moe"),
        GatedMLPMapping(
            me + "linear_fc1.weight", (he + names.expert_gate + ".weight", he + names.expert_up + ".weight"), "moe"
        ),
        Mapping(me + "linear_fc2.weight", (he + names.expert_down + ".weight",), "moe"),
    ]
    if dims.shared_expert_ffn_hidden_size:  # Qwen2-MoE: mlp.shared_expert.* gated by mlp.shared_expert_gate
        ms, hs = m + "mlp.shared_experts.", block + "shared_expert."
        mappings += [
            GatedMLPMapping(ms + "linear_fc1.weight", (hs + "gate_proj.weight", hs + "up_proj.weight"), "moe"),
            Mapping(ms + "linear_fc2.weight", (hs + "down_proj.weight",), "moe"),
            Mapping(ms + "gate_weight", (block + "shared_expert_gate.weight",), "moe"),
        ]
    return mappings


def refuse_sliding_layers(hf: HFConfig) -> None:
    """Qwen configs: sliding-window attention (`use_sliding_window`, `layer_types`) is not supported."""
    sliding = [i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise UnsupportedModelError(
            f"{hf.get('model_type')} with sliding-window attention (use_sliding_window, layer_types {sliding}) is "
            "not supported: set use_sliding_window=false and every layer_types entry to full_attention"
        )


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
