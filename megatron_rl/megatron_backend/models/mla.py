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

This module does not import Megatron at module level (the rollout side imports the models package).
"""

from __future__ import annotations

import functools
import types
from typing import Any

from megatron_rl.megatron_backend.models.family import HFConfig, ModelDims, UnsupportedModelError
from megatron_rl.megatron_backend.models.mapping import Mapping
from megatron_rl.megatron_backend.platform.mcore_compat import mla_resolves_norms_by_backend

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


def mla_layer_spec(config: Any, use_te: bool, vp_stage: int | None) -> Any:
    """The decoder block spec: Megatron's GPT spec, with the local spec's attention bridged (module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    if use_te and config.q_lora_rank is None and mla_resolves_norms_by_backend():
        raise UnsupportedModelError(
            "q_lora_rank=None with the Transformer Engine spec on megatron-core 0.19: its MLA puts a fused RMSNorm "
            "before linear_q_proj that the HF model does not have; use model.options.layer_spec=local"
        )
    if use_te and config.layernorm_epsilon != LATENT_NORM_EPS:
        raise UnsupportedModelError(
            f"rms_norm_eps={config.layernorm_epsilon} with the Transformer Engine spec: its MLA latent norms (fused "
            f"into the up projections) take rms_norm_eps, transformers' take {LATENT_NORM_EPS}; use "
            "model.options.layer_spec=local"
        )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage)
    if use_te:
        return spec
    attention, core_attention, replicated_linear = _local_mla_classes()
    for layer in spec.layer_specs:
        attn = layer.submodules.self_attention
        attn.module = attention
        attn.submodules.core_attention = core_attention
        attn.submodules.linear_q_down_proj = attn.submodules.linear_kv_down_proj = replicated_linear
        latent_norm = _latent_norm(attn.submodules.kv_layernorm)
        attn.submodules.kv_layernorm = latent_norm
        # no query latent, no query norm
        attn.submodules.q_layernorm = latent_norm if config.q_lora_rank is not None else IdentityOp
    return spec


@functools.cache
def _latent_norm(norm: Any) -> type:
    """The spec's RMSNorm built with transformers' latent-norm eps (`LATENT_NORM_EPS`) instead of the eps MLA
    passes (config.layernorm_epsilon)."""

    class _LatentRMSNorm:
        def __new__(cls, *args: Any, eps: float | None = None, **kwargs: Any) -> Any:
            return norm(*args, eps=LATENT_NORM_EPS, **kwargs)

    return _LatentRMSNorm


def _rebound(function: Any, **names: Any) -> types.FunctionType:
    """`function` (same code, defaults and closure) reading some of its module's global names as `names`."""
    rebound = types.FunctionType(
        function.__code__, {**function.__globals__, **names}, function.__name__, function.__defaults__,
        function.__closure__,
    )  # fmt: skip
    rebound.__kwdefaults__ = function.__kwdefaults__
    return rebound


@functools.cache
def _local_mla_classes() -> tuple[type, type, type]:
    """(`_LocalMLASelfAttention`, `_MLADotProductAttention`, the replicated down-projection `Linear`), defined
    once, on first use."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class _MLADotProductAttention(DotProductAttention):
        """Local core attention with MLA's key/value widths: the output is heads x v_head_dim."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kw: Any):
            super().__init__(*args, **kw)
            if v_channels is not None:  # `Attention.__init__` first builds one without them, then MLA rebuilds it
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

        @property
        def hidden_size_per_attention_head_v(self) -> int:
            """The value head width; 0.19.x's MLA widens it while a packed (THD) value is zero-padded to the query
            head width, then trims the output back."""
            return self.hidden_size_per_partition // self.num_attention_heads_per_partition

        @hidden_size_per_attention_head_v.setter
        def hidden_size_per_attention_head_v(self, width: int) -> None:
            self.hidden_size_per_partition = width * self.num_attention_heads_per_partition

    # Megatron's own __init__s, reading HAVE_TE as False (the local spec has no TE module; 0.16.x without TE has
    # mocks under TE's names) and `Linear` as the replicated Linear (0.19.x binds that name only with TE). The
    # base sits under MLASelfAttention in the MRO, so MLASelfAttention's `super().__init__` reaches it.
    base = type(
        "_LocalMultiLatentAttention",
        (mla.MultiLatentAttention,),
        {"__init__": _rebound(mla.MultiLatentAttention.__init__, HAVE_TE=False)},
    )

    class _LocalMLASelfAttention(mla.MLASelfAttention, base):  # type: ignore[misc, valid-type]
        """`MLASelfAttention` building exactly the linear and norm modules the local spec names."""

        __init__ = _rebound(mla.MLASelfAttention.__init__, HAVE_TE=False, Linear=Linear)

        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:  # 0.19.x only
            names = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm", "kv_layernorm")
            return {name: getattr(submodules, name) for name in names}

    return _LocalMLASelfAttention, _MLADotProductAttention, Linear
