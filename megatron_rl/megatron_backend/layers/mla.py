"""Multi-Latent Attention's layer code on Megatron-Core: the decoder block spec, and on the local spec the three
bridges `megatron_rl/models/mla.py` describes (core attention with MLA's value width, replicated down projections,
`MLASelfAttention` building only the modules the local spec names)."""

from __future__ import annotations

import functools
import types
from typing import Any

from megatron_rl.megatron_backend.platform.mcore_compat import mla_resolves_norms_by_backend
from megatron_rl.models.family import UnsupportedModelError
from megatron_rl.models.mla import LATENT_NORM_EPS


def mla_block_spec(config: Any, use_te: bool, vp_stage: int | None) -> Any:
    """The decoder block spec: Megatron's GPT spec, with the local spec's attention bridged
    (`megatron_rl/models/mla.py`'s docstring says why)."""
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
        latent_norm = _latent_norm(attn.submodules.kv_layernorm, LATENT_NORM_EPS)
        attn.submodules.kv_layernorm = latent_norm
        # no query latent, no query norm
        attn.submodules.q_layernorm = latent_norm if config.q_lora_rank is not None else IdentityOp
    return spec


@functools.cache
def _latent_norm(norm: Any, latent_eps: float) -> type:
    """The spec's RMSNorm built with transformers' latent-norm eps (`latent_eps`) instead of the eps MLA passes
    (config.layernorm_epsilon)."""

    class _LatentRMSNorm:
        def __new__(cls, *args: Any, eps: float | None = None, **kwargs: Any) -> Any:
            return norm(*args, eps=latent_eps, **kwargs)

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
