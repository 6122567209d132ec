"""Multi-Latent Attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) on Megatron-Core: config, weights, layer spec.

HF (transformers `DeepseekV3Attention`): q = q_b_proj(RMSNorm(q_a_proj(x))) (or q_proj(x) when `q_lora_rank` is
None), each head [qk_nope_head_dim | qk_rope_head_dim]; the latent kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) |
k_rope (qk_rope_head_dim, one head shared by all)]; kv_b_proj(RMSNorm(c_kv)) gives each head [k_nope | v]. This is
Megatron's `MLASelfAttention` parameter for parameter (names in `mla_mappings`).

RoPE: Megatron's MLA always reads the rotary half as interleaved pairs (rope_utils `_apply_rotary_pos_emb_bshd`,
`multi_latent_attention=True`), which is HF's `rope_interleave=True` (its default; every published DeepSeek-V3,
Kimi-K2 and Moonlight checkpoint). YaRN: the cos/sin scale and the softmax scale follow HF's
`_compute_yarn_parameters` and `yarn_apply_mscale` (see `mla_rope_kwargs`).

The local (no Transformer Engine) spec needs three bridges, applied to the spec built for this model only:
- the local `DotProductAttention` does not accept the `k_channels` / `v_channels` MLA passes and sizes its output
  by `kv_channels`; `_MLADotProductAttention` accepts them and sizes the output by v_head_dim;
- the local spec's down projections are column-parallel: the latent is split over tensor-parallel ranks and
  all-gathered, and the gather's backward only splits, so the shared rotary key's gradient keeps each rank's own
  heads' share (the k_pos_emb rows of linear_kv_down_proj get wrong gradients at TP > 1). Like the TE spec
  (a duplicated `TELinear`), the bridged spec uses a replicated `Linear` (tagged sequence-parallel: its gradients
  are all-reduced over TP), so the rotary key is gathered from the sequence-parallel region, whose backward sums
  every rank's heads;
- megatron-core 0.16.x imports Transformer Engine's names "successfully" without TE (its
  `extensions/transformer_engine.py` builds them on a MagicMock), so `MultiLatentAttention.__init__` runs
  `isinstance(linear_proj, TELinear)` with a mock and raises; 0.19.x accepts the replicated `Linear` only with TE
  installed, resolves the Q/KV norms through the TE backend by default and, with `q_lora_rank=None`, would put a
  norm before `linear_q_proj` that HF does not have. `_LocalMLASelfAttention` builds exactly the modules the
  local spec names.
The Transformer Engine spec is Megatron's own, unchanged. With TP > 1 the model is always sequence-parallel (MoE).

This module is the family's config and weight names; the Megatron layer code (the spec and the bridges) is
`megatron_backend/layers/mla.py`, imported when the spec is built.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.family import HFConfig, ModelDims, UnsupportedModelError
from megatron_rl.models.mapping import Mapping

# transformers builds the latent norms as `DeepseekV3RMSNorm(q_lora_rank)` / `(kv_lora_rank)`: its default eps,
# whatever rms_norm_eps says (Moonlight: 1e-5); Megatron gives them config.layernorm_epsilon.
LATENT_NORM_EPS = 1e-6
# config.json keys `mla_rope_kwargs` and `mla_config_kwargs` read (beside the common ones).
MLA_KEYS = frozenset(
    {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim",
     "rope_interleave", "attention_bias"}
)  # fmt: skip
_YARN_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
     "mscale", "mscale_all_dim"}
)  # fmt: skip


def rope_parameters(hf: HFConfig) -> dict[str, Any]:
    """RoPE settings from transformers 5's `rope_parameters`, or the original `rope_scaling` + `rope_theta`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def mla_rope_kwargs(hf: HFConfig) -> dict[str, Any]:
    """`MLATransformerConfig` RoPE kwargs.

    YaRN (transformers `_compute_yarn_parameters`): cos/sin are scaled by get_mscale(factor, mscale) /
    get_mscale(factor, mscale_all_dim) when both are set, else by get_mscale(factor); the softmax scale by
    get_mscale(factor, mscale_all_dim)**2 (`yarn_apply_mscale`). Megatron scales cos/sin by get_mscale(factor,
    mscale) / get_mscale(factor, mscale_all_dim) and the softmax by get_mscale(rotary_scaling_factor,
    mscale_all_dim)**2 (`MultiLatentAttention.__init__`, also for plain RoPE: mscale_all_dim=0 makes it 1).
    """
    rope = rope_parameters(hf)
    kind = rope["rope_type"]
    if kind == "default":
        return dict(rope_type="rope", rotary_base=float(rope["rope_theta"]), rotary_percent=1.0, mscale_all_dim=0.0)
    if kind != "yarn":
        raise UnsupportedModelError(
            f"RoPE type {kind!r} with Multi-Latent Attention is not supported (only 'default' and 'yarn')"
        )
    unknown = sorted(set(rope) - _YARN_KEYS - {"truncate", "attention_factor"})
    if unknown or rope.get("truncate", True) is not True or rope.get("attention_factor") is not None:
        raise UnsupportedModelError(
            f"YaRN settings {unknown or ['truncate' if 'truncate' in rope else 'attention_factor']} in "
            "rope_parameters are not supported (Megatron's YaRN has the DeepSeek parameters only: factor, "
            "original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim)"
        )
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        raise UnsupportedModelError("YaRN rope_parameters need 'factor' and 'original_max_position_embeddings'")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise UnsupportedModelError(
            "YaRN with mscale_all_dim but no mscale: transformers then scales cos/sin by get_mscale(factor) alone, "
            "Megatron by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim); set mscale"
        )
    return dict(
        rope_type="yarn",
        rotary_base=float(rope["rope_theta"]),
        rotary_scaling_factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(mscale) if mscale and mscale_all_dim else 1.0,
        mscale_all_dim=float(mscale_all_dim or 0.0),
    )


def refuse_unsupported_mla(hf: HFConfig) -> None:
    """MLA settings Megatron's `MLASelfAttention` cannot express, refused by name."""
    if hf.get("attention_bias"):
        raise UnsupportedModelError(
            "attention_bias=true with Multi-Latent Attention: Megatron's MLA projections have no biases"
        )
    if not hf.get("rope_interleave", True):
        raise UnsupportedModelError(
            "rope_interleave=false with Multi-Latent Attention: Megatron's MLA reads the rotary dimensions as "
            "interleaved pairs (transformers' rope_interleave=true, the published checkpoints' layout)"
        )
    if int(hf.get("num_key_value_heads") or hf["num_attention_heads"]) != int(hf["num_attention_heads"]):
        raise UnsupportedModelError(
            f"num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={hf['num_attention_heads']}: "
            "Multi-Latent Attention expands its latent into one key and value per head"
        )
    mla_rope_kwargs(hf)


def mla_config_kwargs(hf: HFConfig, dims: ModelDims) -> dict[str, Any]:
    """`MLATransformerConfig` attention kwargs (the family adds the rest). `qk_layernorm=True` makes the local
    spec build the q_a / kv_a RMSNorms (IdentityOp otherwise)."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=dims.q_lora_rank or None,
        kv_lora_rank=dims.kv_lora_rank,
        qk_head_dim=dims.head_dim - dims.qk_rope_head_dim,
        qk_pos_emb_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        qk_layernorm=True,
        apply_rope_fusion=False,
        **mla_rope_kwargs(hf),
    )


def mla_mappings(dims: ModelDims) -> list[Mapping]:
    """HF `self_attn.*` <-> Megatron `self_attention.*` of every layer (the same layouts: no tensor transform)."""
    m, h = "decoder.layers.{layer}.self_attention.", "model.layers.{layer}.self_attn."
    pairs = [
        ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
        ("kv_layernorm", "kv_a_layernorm"),
        ("linear_kv_up_proj", "kv_b_proj"),
        ("linear_proj", "o_proj"),
    ]
    if dims.q_lora_rank:
        pairs += [
            ("linear_q_down_proj", "q_a_proj"),
            ("q_layernorm", "q_a_layernorm"),
            ("linear_q_up_proj", "q_b_proj"),
        ]
    else:
        pairs.append(("linear_q_proj", "q_proj"))
    return [Mapping(f"{m}{meg}.weight", (f"{h}{hf}.weight",)) for meg, hf in pairs]
