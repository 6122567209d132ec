"""What a model family provides: HF config -> Megatron config, layer spec, and HF <-> Megatron weight names.

A family is one module under `megatron_rl/megatron_backend/models/` that registers a `ModelFamily`.
Weight rules are expressed on *global, unsharded* Megatron names (global layer and expert indices);
sharding for tensor/expert/pipeline parallelism is applied generically in `hf_weights.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

HFConfig = dict[str, Any]


class UnsupportedModelError(ValueError):
    """The HF config or checkpoint describes a model this project cannot build."""


@dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter and the HF tensors it is made of.

    `megatron` and `hf` may contain `{layer}` and `{expert}` placeholders (global indices).
    `to_megatron(list of HF tensors) -> Megatron tensor`; `to_hf(Megatron tensor) -> list of HF tensors`.
    """

    megatron: str
    hf: tuple[str, ...]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor] = lambda ts: ts[0]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]] = lambda t: [t]
    # Megatron shards a gated-linear-unit fc1 as [gate_r; up_r] per rank: gather/scatter by halves.
    glu: bool = False


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
    num_experts: int = field(metadata={"hf_keys": ("num_experts", "num_local_experts")})
    top_k: int = field(metadata={"hf_keys": ("num_experts_per_tok",)})
    # 1 = MoE layer, 0 = dense layer, per global layer index
    moe_layer_pattern: tuple[int, ...]
    # one expert's MLP (Mixtral: intermediate_size)
    moe_ffn_hidden_size: int = field(default=0, metadata={"hf_keys": ("moe_intermediate_size", "intermediate_size")})
    ffn_hidden_size: int = field(default=0, metadata={"hf_keys": ("intermediate_size",)})  # dense layers' MLP
    tie_word_embeddings: bool = field(default=False, metadata={"hf_keys": ("tie_word_embeddings",)})
    # HF softmaxes over all experts, then renormalises the top-k probabilities (Qwen `norm_topk_prob`)
    renormalize_top_k: bool = field(default=False, metadata={"hf_keys": ("norm_topk_prob",)})
    shared_expert_ffn_hidden_size: int = field(default=0, metadata={"hf_keys": ("shared_expert_intermediate_size",)})
    qk_layernorm: bool = False  # RMSNorm on each query and key head
    qkv_bias: bool = field(default=False, metadata={"hf_keys": ("qkv_bias", "attention_bias")})

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, is_moe in enumerate(self.moe_layer_pattern) if is_moe]


@dataclass(frozen=True)
class ModelFamily:
    """Registered per HF `model_type`."""

    model_type: str
    dims: Callable[[HFConfig], ModelDims]
    transformer_config_kwargs: Callable[[HFConfig], dict[str, Any]]
    gpt_model_kwargs: Callable[[HFConfig], dict[str, Any]]
    weight_rules: Callable[[HFConfig], list[WeightRule]]
    hf_architecture: str
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    if family.model_type in _FAMILIES:
        raise ValueError(f"model family {family.model_type!r} registered twice")
    _FAMILIES[family.model_type] = family
    return family


def get_family(hf_config: HFConfig) -> ModelFamily:
    """The family for an HF config dict, or a clear error listing the supported `model_type`s."""
    model_type = hf_config.get("model_type")
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture: config.json has model_type={model_type!r} "
            f"(architectures={hf_config.get('architectures')}); supported model types: {sorted(_FAMILIES)}"
        )
    return _FAMILIES[model_type]


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


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


def split_qkv_to_hf(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> list[torch.Tensor]:
    """Megatron's grouped [g: q_heads_of_group, k, v] layout -> HF q, k, v."""
    heads_per_group = num_heads // num_groups
    hidden = qkv.shape[-1]
    grouped = qkv.view(num_groups, (heads_per_group + 2) * head_dim, hidden)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]


def merge_qkv_from_hf(tensors: list[torch.Tensor], num_heads: int, num_groups: int, head_dim: int) -> torch.Tensor:
    """HF q, k, v -> Megatron's grouped layout (each query group followed by its key and value head)."""
    q, k, v = tensors
    heads_per_group = num_heads // num_groups
    hidden = q.shape[-1]
    q = q.view(num_groups, heads_per_group * head_dim, hidden)
    k = k.view(num_groups, head_dim, hidden)
    v = v.view(num_groups, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)
