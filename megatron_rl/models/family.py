"""What a model family provides: HF config -> Megatron config, layer spec, and HF <-> Megatron weight names.

A family is one module under `megatron_rl/models/` that registers a `ModelFamily`: a small
declarative spec (config translation, layer-spec hook, wildcard weight mappings from `mapping.py`). Sharding for
tensor/expert/pipeline parallelism is applied generically in `hf_weights.py`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megatron_rl.models.mapping import Mapping, WeightMap

HFConfig = dict[str, Any]


class UnsupportedModelError(ValueError):
    """The HF config or checkpoint describes a model this project cannot build."""


class WeightMismatchError(ValueError):
    """A checkpoint tensor does not fit the model built from the config."""


@dataclass(frozen=True)
class ModelDims:
    """Architecture facts every other part of the trainer needs, derived once from the HF config by the family.

    `hf_keys` in a field's metadata are the config.json keys it may come from, which architecture-mismatch errors
    name (else the field's own name); they compare the fields in this order.
    """

    model_type: str = field(metadata={"hf_keys": ("model_type",)})
    vocab_size: int = field(metadata={"hf_keys": ("vocab_size",)})
    hidden_size: int = field(metadata={"hf_keys": ("hidden_size",)})
    num_layers: int = field(metadata={"hf_keys": ("num_hidden_layers",)})
    num_attention_heads: int = field(metadata={"hf_keys": ("num_attention_heads",)})
    num_query_groups: int = field(metadata={"hf_keys": ("num_key_value_heads",)})
    head_dim: int = field(metadata={"hf_keys": ("head_dim",)})  # Megatron's kv_channels
    max_position_embeddings: int = field(metadata={"hf_keys": ("max_position_embeddings",)})
    num_experts: int = field(metadata={"hf_keys": ("num_experts", "num_local_experts", "n_routed_experts")})
    top_k: int = field(metadata={"hf_keys": ("num_experts_per_tok",)})
    # 1 = MoE layer, 0 = dense layer, per global layer index
    moe_layer_pattern: tuple[int, ...]
    # one expert's MLP (Mixtral: intermediate_size)
    moe_ffn_hidden_size: int = field(default=0, metadata={"hf_keys": ("moe_intermediate_size", "intermediate_size")})
    ffn_hidden_size: int = field(default=0, metadata={"hf_keys": ("intermediate_size",)})  # dense layers' MLP
    tie_word_embeddings: bool = field(default=False, metadata={"hf_keys": ("tie_word_embeddings",)})
    # HF softmaxes over all experts, then renormalises the top-k probabilities (Qwen `norm_topk_prob`)
    renormalize_top_k: bool = field(default=False, metadata={"hf_keys": ("norm_topk_prob",)})
    shared_expert_ffn_hidden_size: int = field(
        default=0, metadata={"hf_keys": ("shared_expert_intermediate_size", "n_shared_experts")}
    )
    qk_layernorm: bool = field(default=False, metadata={"hf_keys": ("use_qk_norm",)})  # RMSNorm per q/k head
    qkv_bias: bool = field(default=False, metadata={"hf_keys": ("qkv_bias", "attention_bias")})
    # Multi-Latent Attention (DeepSeek-V3): 0 = ordinary attention. The KV cache holds kv_lora_rank +
    # qk_rope_head_dim values per token and layer instead of 2 * num_query_groups * head_dim.
    kv_lora_rank: int = field(default=0, metadata={"hf_keys": ("kv_lora_rank",)})
    q_lora_rank: int = field(default=0, metadata={"hf_keys": ("q_lora_rank",)})
    qk_rope_head_dim: int = field(default=0, metadata={"hf_keys": ("qk_rope_head_dim",)})
    v_head_dim: int = field(default=0, metadata={"hf_keys": ("v_head_dim",)})

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, is_moe in enumerate(self.moe_layer_pattern) if is_moe]

    def layout_checks(self) -> dict[str, Any]:
        """The model's sizes `ParallelLayout.validate` checks a layout against."""
        return {
            "num_layers": self.num_layers,
            "num_experts": self.num_experts or None,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "is_moe": self.num_experts > 0,
        }


# Keys of config.json that do not change the forward pass: metadata, generation and initialisation settings,
# and training-time regularisers the trainer never applies (dropout, router jitter, HF's aux loss).
METADATA_KEYS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache", "return_dict",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "initializer_range", "output_attentions", "output_hidden_states", "output_router_logits",
        "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "hidden_dropout", "id2label",
        "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
        "tokenizer_class", "auto_map", "pretraining_tp", "tie_encoder_decoder", "add_cross_attention",
        "cross_attention_hidden_size", "pruned_heads", "finetuning_task", "prefix", "task_specific_params",
        "torchscript", "use_bfloat16", "tf_legacy_loss", "num_labels",
    }
)  # fmt: skip
# Every family reads these (`ModelDims`' common fields and RoPE).
COMMON_KEYS = frozenset(
    {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "hidden_act", "intermediate_size",
        "num_experts_per_tok", "rope_theta", "rope_scaling", "rope_parameters",
    }
)  # fmt: skip

# Records the top-k expert ids an HF model picks, by hooking its modules: `(model, sink) -> handles`, where
# `sink(indices)` takes `[tokens, top_k]` per MoE layer in layer order (the local engine's R3 routes).
RouteRecorder = Callable[[Any, Callable[[torch.Tensor], None]], list[Any]]


def record_gate_routes(model: Any, sink: Callable[[torch.Tensor], None]) -> list[Any]:
    """Qwen-MoE / Mixtral style: every `*.gate` router module returns `(logits, scores, top-k indices)`."""
    routers = [m for n, m in model.named_modules() if n.endswith(".gate") and hasattr(m, "top_k")]
    return [r.register_forward_hook(lambda _m, _i, out: sink(out[2].detach())) for r in routers]


@dataclass(frozen=True)
class ModelFamily:
    """A family: its HF `model_type`, how its HF config becomes a Megatron config, and its weight mappings.

    `config_keys`: config.json keys the family reads or checks besides `COMMON_KEYS`; any key outside these and
    `METADATA_KEYS` is refused by name (it may change the math). `config_class`: Megatron's
    `TransformerConfig` or `MLATransformerConfig`; `config_attributes`: attributes set on the built config that
    its class does not declare (YaRN's `yarn_*` for GPTModel). `layer_spec`: the name of the decoder block spec in
    `megatron_backend.layers.BLOCK_SPECS` (Megatron layer code, kept out of the family), Megatron's GPT spec when
    None. `unused_hf_tensors`: `(regex, why)` of tensors checkpoints carry that the model does not use (MTP layers),
    or a function of the config giving them: reported as skipped by
    name, kept by conversion round trips.
    """

    model_type: str
    hf_architecture: str
    dims: Callable[[HFConfig], ModelDims]
    transformer_config_kwargs: Callable[[HFConfig], dict[str, Any]]
    gpt_model_kwargs: Callable[[HFConfig], dict[str, Any]]
    mappings: Callable[[HFConfig], list[Mapping]]
    config_keys: frozenset[str] = frozenset()
    config_class: Literal["transformer", "mla"] = "transformer"
    config_attributes: Callable[[HFConfig], dict[str, Any]] | None = None
    layer_spec: str | None = None
    unused_hf_tensors: Callable[[HFConfig], tuple[tuple[str, str], ...]] | tuple[tuple[str, str], ...] = ()
    record_routes: RouteRecorder = record_gate_routes
    supports: str = ""  # one line for `megatron-rl models`

    def check_keys(self, hf: HFConfig) -> None:
        known = METADATA_KEYS | COMMON_KEYS | self.config_keys  # once per call, not once per key
        unknown = sorted(k for k in hf if not k.startswith("_") and k not in known)
        if unknown:
            raise UnsupportedModelError(
                f"config.json (model_type={self.model_type!r}) has fields this project does not translate: {unknown}; "
                "each may change the model's math, so the model is refused rather than built differently. Remove "
                "them if they are not part of the architecture, or open an issue naming the field"
            )

    def weight_map(self, hf: HFConfig) -> WeightMap:
        """The model's weight map (built once per config: the mappings are few, rules resolve lazily)."""
        return _weight_map(self, json.dumps(hf, sort_keys=True, default=str))

    def unused_tensor_reason(self, name: str, hf: HFConfig) -> str | None:
        """Why the model does not use checkpoint tensor `name` (None: it should). The patterns may depend on the
        config (MTP layers are numbered from num_hidden_layers)."""
        unused = self.unused_hf_tensors
        patterns = unused(hf) if callable(unused) else unused
        return next((why for pattern, why in patterns if re.fullmatch(pattern, name)), None)


@functools.lru_cache(maxsize=16)
def _weight_map(family: ModelFamily, hf_json: str) -> WeightMap:
    hf = json.loads(hf_json)
    dims = family.dims(hf)
    return WeightMap(family.mappings(hf), dims.moe_layer_pattern, dims.num_experts, dims.tie_word_embeddings)


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    if family.model_type in _FAMILIES:
        raise ValueError(f"model family {family.model_type!r} registered twice")
    _FAMILIES[family.model_type] = family
    return family


def get_family(hf_config: HFConfig) -> ModelFamily:
    """The family for an HF config dict (its fields checked), or a clear error listing the supported types."""
    model_type = hf_config.get("model_type")
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture: config.json has model_type={model_type!r} "
            f"(architectures={hf_config.get('architectures')}); supported model types: {sorted(_FAMILIES)}"
        )
    family = _FAMILIES[model_type]
    family.check_keys(hf_config)
    return family


def supported_families() -> list[ModelFamily]:
    return [_FAMILIES[k] for k in sorted(_FAMILIES)]


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def decoder_dims(hf: HFConfig, model_type: str, *, default_positions: int, **deltas: Any) -> ModelDims:
    """A decoder's `ModelDims` from the config.json keys the families read alike (transformers' names: vocabulary,
    widths, layers, heads and query groups, head_dim or hidden / heads, positions with the family's
    `default_positions`, tied embeddings, top-k, the dense FFN), with `deltas` for the fields the family reads
    otherwise or adds (experts, MoE layers, shared experts, norms, biases, MLA). Refuses heads that are not a
    multiple of the query groups."""
    heads = int(hf["num_attention_heads"])
    common: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings", default_positions)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        top_k=int(hf["num_experts_per_tok"]),
        ffn_hidden_size=int(hf["intermediate_size"]),
    )
    common.update(deltas)
    if heads % common["num_query_groups"]:
        raise UnsupportedModelError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={common['num_query_groups']}"
        )
    return ModelDims(**common)


def require_keys(hf_config: HFConfig, *keys: str) -> None:
    missing = [k for k in keys if k not in hf_config]
    if missing:
        raise UnsupportedModelError(
            f"config.json for model_type={hf_config.get('model_type')!r} lacks required keys {missing}"
        )


def rope_theta(hf_config: HFConfig) -> float:
    """RoPE base from either the classic `rope_theta` key or transformers 5 `rope_parameters`."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported yet (only 'default'); remove rope_scaling or "
            "convert with a supported configuration"
        )
    theta = hf_config.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise UnsupportedModelError("config.json has no rope_theta (neither top-level nor in rope_parameters)")
    return float(theta)
