"""GPT-OSS (HF `model_type: gpt_oss`: openai/gpt-oss-20b, gpt-oss-120b).

Architecture (transformers `models/gpt_oss/modeling_gpt_oss.py`): pre-norm RMSNorm decoder, GQA attention with
biases on q/k/v/o and one learnable attention sink per head (`self_attn.sinks`: an extra logit in each row's
softmax whose probability is dropped), sliding-window attention on the layers `layer_types` marks
`sliding_attention` (a query sees its own and the `sliding_window - 1` previous tokens), YaRN RoPE, every layer
MoE: a router with bias whose top-k logits are softmaxed, and experts with biases computing a clamped SwiGLU
with an offset, `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = clamp(gate, max=limit)`.

Megatron-Core equivalents (config fields both layer specs read; checked here on the local spec, with the local
modules `layer_spec` substitutes): `softmax_type="learnable"` (the sinks are
`core_attention.softmax_offset`), `window_size=(sliding_window - 1, 0)` with `window_attn_skip_freq` the
per-layer list (1 = windowed), `glu_linear_offset=1`, `activation_func_clamp_value=limit`, and an activation
`x * sigmoid(alpha * x)`; `add_bias_linear` gives the router, attention and expert biases. YaRN:
`position_embedding_type="yarn"` reads `config.yarn_*` attributes TransformerConfig does not declare
(`gpt_model.py`, YarnRotaryEmbedding), set after construction (`config_attributes`).

HF stores each layer's experts fused: `mlp.experts.gate_up_proj` `[E, hidden, 2I]` applied as `x @ W[e]` with
the gate in the even and the up projection in the odd columns (`GptOssExperts._apply_gate`), its bias
`gate_up_proj_bias` `[E, 2I]` interleaved the same way, `down_proj` `[E, I, hidden]` applied as `h @ W[e]`, and
`down_proj_bias` `[E, hidden]`. Megatron's expert `linear_fc1` is `[gate; up]` `[2I, hidden]` applied as
`x @ W.T`, `linear_fc2` is `[hidden, I]`.

MXFP4 checkpoints (the published gpt-oss weights: `quantization_config.quant_method == "mxfp4"`, experts stored
as `*_blocks` / `*_scales`) are refused with instructions to dequantise first (transformers' `Mxfp4Config(
dequantize=True)` drops `quantization_config` from the config it saves). `hidden_act` is ignored, as transformers'
GPT-OSS ignores it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from megatron_rl.models.family import (
    HFConfig,
    ModelDims,
    ModelFamily,
    UnsupportedModelError,
    decoder_dims,
    register_family,
    require_keys,
)
from megatron_rl.models.mapping import Mapping, QKVMapping
from megatron_rl.models.moe_decoder import decoder_transformer_config

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
DEFAULT_SWIGLU_ALPHA = 1.702  # GptOssConfig.swiglu_alpha; the published checkpoints do not write it
DEFAULT_SWIGLU_LIMIT = 7.0
LAYER_TYPES = ("sliding_attention", "full_attention")

DEQUANTISE_HINT = (
    "dequantise it once and point the run at the copy: "
    "`from transformers import AutoModelForCausalLM, Mxfp4Config; "
    "m = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
    "dtype='bfloat16'); m.save_pretrained(out)`"
)


# --------------------------------------------------------------------------------------
# Config translation
# --------------------------------------------------------------------------------------


def _refuse_quantized(hf: HFConfig) -> None:
    quant = hf.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    raise UnsupportedModelError(
        f"gpt_oss checkpoint is quantised (quantization_config.quant_method={method!r}); training needs the "
        f"full-precision weights: {DEQUANTISE_HINT}"
    )


def layer_types(hf: HFConfig) -> list[str]:
    """Each layer's attention kind; transformers' default alternates sliding (even layers) and full."""
    n = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if len(kinds) != n or unknown:
        raise UnsupportedModelError(
            f"gpt_oss layer_types must list {n} entries of {list(LAYER_TYPES)}; got {len(kinds)} with {unknown}"
        )
    if "sliding_attention" in kinds and not hf.get("sliding_window"):
        raise UnsupportedModelError("gpt_oss layer_types has sliding_attention layers but no sliding_window > 0")
    return list(kinds)


def rope_parameters(hf: HFConfig) -> dict[str, Any]:
    """The RoPE settings: transformers 5's `rope_parameters`, or the published checkpoints' `rope_scaling` plus a
    top-level `rope_theta`. Neither is refused: transformers would fill in GptOssConfig's YaRN defaults."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if not params:
        raise UnsupportedModelError(
            "gpt_oss config.json has neither rope_parameters nor rope_scaling (transformers would assume its YaRN "
            "defaults): load and re-save the model with transformers so that the config states its RoPE"
        )
    params.setdefault("rope_type", params.pop("type", "default"))
    if "rope_theta" not in params:
        if "rope_theta" not in hf:
            raise UnsupportedModelError(
                "gpt_oss config.json has no rope_theta (neither top-level nor in rope_parameters)"
            )
        params["rope_theta"] = hf["rope_theta"]
    if params["rope_type"] not in ("yarn", "default"):
        raise UnsupportedModelError(f"gpt_oss with rope_type={params['rope_type']!r}: only 'yarn' and 'default'")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("gpt_oss with partial_rotary_factor != 1 is not supported")
    if params.get("attention_factor") is not None:
        raise UnsupportedModelError(
            "gpt_oss YaRN with an explicit attention_factor is not supported (Megatron derives it from factor, "
            "mscale and mscale_all_dim)"
        )
    return params


def dims(hf: HFConfig) -> ModelDims:
    require_keys(hf, *REQUIRED_KEYS)
    _refuse_quantized(hf)
    if not hf.get("attention_bias", True):
        raise UnsupportedModelError(
            "gpt_oss with attention_bias=false is not supported: Megatron's add_bias_linear gives the attention "
            "the biases the router and experts need"
        )
    top_k = int(hf["num_experts_per_tok"])
    if int(hf.get("experts_per_token", top_k)) != top_k:
        raise UnsupportedModelError(
            f"gpt_oss config.json has experts_per_token={hf['experts_per_token']} != num_experts_per_tok={top_k}"
        )
    layer_types(hf)
    rope_parameters(hf)
    return decoder_dims(
        hf,
        "gpt_oss",
        default_positions=131072,
        num_experts=int(hf["num_local_experts"]),
        moe_layer_pattern=(1,) * int(hf["num_hidden_layers"]),
        moe_ffn_hidden_size=int(hf["intermediate_size"]),
        qkv_bias=True,
        # HF softmaxes the top-k router logits = Megatron's moe_router_pre_softmax=False
        renormalize_top_k=True,
    )


def sigmoid_gate(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate activation `x * sigmoid(alpha * x)` (`GptOssExperts._apply_gate`); Megatron's `quick_gelu`
    is this with alpha fixed at 1.702 and compiled, so the family passes its own."""
    return x * torch.sigmoid(alpha * x)


def transformer_config_kwargs(hf: HFConfig) -> dict[str, Any]:
    d = dims(hf)
    kinds = layer_types(hf)
    kwargs = decoder_transformer_config(hf, d)
    kwargs.update(
        activation_func=functools.partial(sigmoid_gate, alpha=float(hf.get("swiglu_alpha", DEFAULT_SWIGLU_ALPHA))),
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf.get("swiglu_limit", DEFAULT_SWIGLU_LIMIT)),
        add_bias_linear=True,  # router, q/k/v/o and expert biases
        add_qkv_bias=True,
        bias_activation_fusion=False,
        softmax_type="learnable",
    )
    if "sliding_attention" in kinds:
        kwargs.update(
            window_size=(int(hf["sliding_window"]) - 1, 0),  # HF: key j visible to query i iff i - W < j <= i
            window_attn_skip_freq=[int(kind == "sliding_attention") for kind in kinds],  # 1 = windowed layer
        )
    return kwargs


def config_attributes(hf: HFConfig) -> dict[str, Any]:
    """YaRN's `yarn_*` attributes, which GPTModel reads from the config (gpt_model.py, `position_embedding_type
    == "yarn"`) and `TransformerConfig` does not declare; matched to transformers' `_compute_yarn_parameters`."""
    rope = rope_parameters(hf)
    if rope["rope_type"] != "yarn":
        return {}
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or int(hf.get("max_position_embeddings", 131072)) / original
    mscale, mscale_all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    both = bool(mscale and mscale_all_dim)  # HF uses the pair only when both are non-zero, Megatron when not None
    return dict(
        yarn_rotary_scaling_factor=float(factor),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        yarn_mscale=float(mscale) if both else None,
        yarn_mscale_all_dim=float(mscale_all_dim) if both else None,
        yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
    )


def gpt_model_kwargs(hf: HFConfig) -> dict[str, Any]:
    d = dims(hf)
    rope = rope_parameters(hf)
    return dict(
        max_sequence_length=d.max_position_embeddings,
        position_embedding_type="yarn" if rope["rope_type"] == "yarn" else "rope",
        rotary_base=float(rope["rope_theta"]),
        rotary_percent=1.0,
        share_embeddings_and_output_weights=d.tie_word_embeddings,
    )


# --------------------------------------------------------------------------------------
# Weight mappings
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InterleavedGLUMapping(Mapping):
    """One expert's slice of HF `gate_up_proj` (`[hidden, 2I]`, applied as `x @ W`) or `gate_up_proj_bias`
    (`[2I]`), gate in the even and up in the odd columns <-> Megatron's expert fc1 `[gate; up]` (`[2I, hidden]` /
    `[2I]`)."""

    glu_halves: ClassVar[bool] = True

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        rows = tensors[0].t() if tensors[0].dim() == 2 else tensors[0]  # [2I, ...] in HF's interleaved order
        return torch.cat([rows[0::2], rows[1::2]], dim=0)

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gate, up = tensor.chunk(2, dim=0)
        rows = torch.stack([gate, up], dim=1).reshape(tensor.shape)  # gate_0, up_0, gate_1, up_1, ...
        return [rows.t().contiguous() if rows.dim() == 2 else rows]


@dataclasses.dataclass(frozen=True)
class TransposedMapping(Mapping):
    """One expert's slice of HF `down_proj` (`[I, hidden]`, applied as `h @ W`) <-> Megatron's fc2 `[hidden, I]`."""

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0].t().contiguous()

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.t().contiguous()]


def _qkv(d: ModelDims, megatron: str, h: str, kind: str) -> QKVMapping:
    hf = tuple(f"{h}self_attn.{p}_proj.{kind}" for p in "qkv")
    return QKVMapping(megatron, hf, heads=d.num_attention_heads, groups=d.num_query_groups, head_dim=d.head_dim)


def mappings(hf: HFConfig) -> list[Mapping]:
    d = dims(hf)
    m, h = "decoder.layers.{layer}.", "model.layers.{layer}."
    me, he = m + "mlp.experts.local_experts.{expert}.", h + "mlp.experts."
    out = [
        Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab_padded=True),
        Mapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not d.tie_word_embeddings:
        out.append(Mapping("output_layer.weight", ("lm_head.weight",), vocab_padded=True))
    out += [
        Mapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",)),
        _qkv(d, m + "self_attention.linear_qkv.weight", h, "weight"),
        _qkv(d, m + "self_attention.linear_qkv.bias", h, "bias"),
        Mapping(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",)),
        Mapping(m + "self_attention.linear_proj.bias", (h + "self_attn.o_proj.bias",)),
        Mapping(m + "self_attention.core_attention.softmax_offset", (h + "self_attn.sinks",)),
        Mapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
        Mapping(m + "mlp.router.weight", (h + "mlp.router.weight",)),
        Mapping(m + "mlp.router.bias", (h + "mlp.router.bias",)),
        InterleavedGLUMapping(me + "linear_fc1.weight", (he + "gate_up_proj",)),
        InterleavedGLUMapping(me + "linear_fc1.bias", (he + "gate_up_proj_bias",)),
        TransposedMapping(me + "linear_fc2.weight", (he + "down_proj",)),
        Mapping(me + "linear_fc2.bias", (he + "down_proj_bias",)),
    ]
    return out


def record_router_routes(model: Any, sink: Callable[[torch.Tensor], None]) -> list[Any]:
    """HF GPT-OSS: every `mlp.router` (GptOssTopKRouter) returns `(logits, scores, top-k indices)`."""
    routers = [module for name, module in model.named_modules() if name.endswith("mlp.router")]
    return [r.register_forward_hook(lambda _m, _i, out: sink(out[2].detach())) for r in routers]


FAMILY = register_family(
    ModelFamily(
        model_type="gpt_oss",
        hf_architecture="GptOssForCausalLM",
        dims=dims,
        transformer_config_kwargs=transformer_config_kwargs,
        gpt_model_kwargs=gpt_model_kwargs,
        mappings=mappings,
        config_keys=frozenset(
            {
                "attention_bias",
                "experts_per_token",
                "initial_context_length",
                "layer_types",
                "num_local_experts",
                "quantization_config",
                "sliding_window",
                "swiglu_alpha",
                "swiglu_limit",
            }
        ),
        config_attributes=config_attributes,
        layer_spec="gpt_oss",
        record_routes=record_router_routes,
        supports="attention sinks, alternating sliding window, YaRN, clamped SwiGLU experts with biases, router "
        "bias; fused expert tensors; MXFP4 checkpoints refused (dequantise first)",
    )
)
