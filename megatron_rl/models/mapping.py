"""Declarative HF <-> Megatron weight mappings, written once per family with wildcards and resolved lazily.

A family lists a few `Mapping`s on *global, unsharded, local-spec* Megatron names, with `{layer}` and `{expert}`
wildcards (`decoder.layers.{layer}.mlp.linear_fc2.weight` <-> `model.layers.{layer}.mlp.down_proj.weight`), in
the manner of Megatron-Bridge's `AutoMapping` / `QKVMapping` / `GatedMLPMapping`. `WeightMap` resolves a concrete
parameter name to its `WeightRule` by pattern match when asked (nothing is expanded per parameter up front), walks
the names in one fixed order for export, and assembles HF tensors that stack all experts (GPT-OSS's 3-D expert
tensors: many Megatron parameters <-> one HF tensor). Tensor-parallel sharding is applied generically in
`hf_weights.py`; the kinds below only say how HF tensors combine into one full Megatron tensor and back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

LAYER, EXPERT = "{layer}", "{expert}"
# Transformer Engine spec names -> the local spec names mappings are written in (TE fuses the pre-norms).
TE_ALIASES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    # Multi-Latent Attention: TE fuses the query and KV latent norms into the up projections.
    (".self_attention.linear_q_up_proj.layer_norm_weight", ".self_attention.q_layernorm.weight"),
    (".self_attention.linear_kv_up_proj.layer_norm_weight", ".self_attention.kv_layernorm.weight"),
)


def canonical_name(name: str) -> str:
    """A parameter name in the local-spec spelling mappings use (Transformer Engine names translated)."""
    for te_name, local_name in TE_ALIASES:
        if name.endswith(te_name):
            return name[: -len(te_name)] + local_name
    return name


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter pattern <-> the HF tensor pattern(s) it is made of; one-to-one as it stands.

    `layers`: which decoder layers a `{layer}` pattern covers (MoE layers, dense layers or all).
    `vocab_padded`: dim 0 is the vocabulary, padded to Megatron's multiple on load and cut back on export.
    If the Megatron pattern has `{expert}` and the HF patterns do not, each HF tensor stacks every expert along
    dim 0 and `to_megatron` / `to_hf` see one expert's slice.
    """

    megatron: str
    hf: tuple[str, ...]
    layers: Literal["all", "moe", "dense"] = "all"
    vocab_padded: bool = False
    # Megatron shards a gated-linear-unit fc1 as [gate_r; up_r] per tensor-parallel rank.
    glu_halves: ClassVar[bool] = False

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0]

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    @property
    def fused_experts(self) -> bool:
        return EXPERT in self.megatron and not any(EXPERT in h for h in self.hf)


@dataclass(frozen=True)
class QKVMapping(Mapping):
    """HF q, k, v (weights or biases) <-> Megatron's grouped layout: each query group, then its key and value head."""

    heads: int = 0
    groups: int = 0
    head_dim: int = 0

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = (t if t.dim() == 2 else t.unsqueeze(-1) for t in tensors)
        cols = q.shape[-1]
        per_group = self.heads // self.groups
        grouped = [
            q.reshape(self.groups, per_group * self.head_dim, cols),
            k.reshape(self.groups, self.head_dim, cols),
            v.reshape(self.groups, self.head_dim, cols),
        ]
        merged = torch.cat(grouped, dim=1).reshape(-1, cols)
        return merged if tensors[0].dim() == 2 else merged.squeeze(-1)

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        full = tensor if tensor.dim() == 2 else tensor.unsqueeze(-1)
        per_group = self.heads // self.groups
        grouped = full.reshape(self.groups, (per_group + 2) * self.head_dim, full.shape[-1])
        parts = torch.split(grouped, [per_group * self.head_dim, self.head_dim, self.head_dim], dim=1)
        out = [p.reshape(-1, full.shape[-1]) for p in parts]
        return out if tensor.dim() == 2 else [p.squeeze(-1) for p in out]


@dataclass(frozen=True)
class GatedMLPMapping(Mapping):
    """HF gate and up projections <-> Megatron's fc1 = [gate; up] (a gated linear unit)."""

    glu_halves: ClassVar[bool] = True

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors, dim=0)

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(tensor.chunk(2, dim=0))


@dataclass(frozen=True)
class WeightRule:
    """A concrete Megatron parameter (global layer/expert indices) and the HF tensors it is made of.

    `expert_slot`: for fused expert mappings, this parameter's index along dim 0 of each HF tensor.
    """

    megatron: str
    hf: tuple[str, ...]
    mapping: Mapping
    expert_slot: int | None = None

    @property
    def glu(self) -> bool:
        return self.mapping.glu_halves

    @property
    def vocab_padded(self) -> bool:
        return self.mapping.vocab_padded

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return self.mapping.to_megatron(tensors)

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.mapping.to_hf(tensor)


def _pattern(megatron: str) -> re.Pattern[str]:
    escaped = re.escape(megatron).replace(re.escape(LAYER), r"(?P<layer>\d+)").replace(re.escape(EXPERT), r"(?P<e>\d+)")
    return re.compile(escaped + "$")


@dataclass
class WeightMap:
    """A family's mappings for one model: rules resolved by name on demand, names walked in one fixed order.

    `moe_layer_pattern`: 1 for an MoE layer, 0 for a dense one, per global layer. With tied embeddings the last
    pipeline stage's own copy of the output layer reads the embedding (it is not exported: HF has no lm_head).
    """

    mappings: list[Mapping]
    moe_layer_pattern: tuple[int, ...]
    num_experts: int
    tie_word_embeddings: bool = False
    _patterns: list[tuple[re.Pattern[str], Mapping]] = field(init=False, repr=False)
    _hf_names: set[str] | None = field(default=None, init=False, repr=False)
    _layer_sets: dict[str, list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._patterns = [(_pattern(m.megatron), m) for m in self.mappings]
        pattern = self.moe_layer_pattern
        self._layer_sets = {
            "all": list(range(len(pattern))),
            "moe": [i for i, moe in enumerate(pattern) if moe],
            "dense": [i for i, moe in enumerate(pattern) if not moe],
        }
        if self.tie_word_embeddings:
            embedding = next(m for m in self.mappings if m.megatron == "embedding.word_embeddings.weight")
            tied = Mapping("output_layer.weight", embedding.hf, vocab_padded=True)
            self._patterns.append((_pattern(tied.megatron), tied))

    def _layers(self, mapping: Mapping) -> list[int]:
        return self._layer_sets[mapping.layers]

    def _resolve(self, mapping: Mapping, layer: int | None, expert: int | None) -> WeightRule:
        def fill(pattern: str) -> str:
            if layer is not None:
                pattern = pattern.replace(LAYER, str(layer))
            return pattern.replace(EXPERT, str(expert)) if expert is not None else pattern

        slot = expert if mapping.fused_experts else None
        return WeightRule(fill(mapping.megatron), tuple(fill(h) for h in mapping.hf), mapping, slot)

    def rule(self, name: str) -> WeightRule | None:
        """The rule of a (canonical, global) Megatron name, or None when no mapping covers it."""
        for pattern, mapping in self._patterns:
            match = pattern.match(name)
            if match is None:
                continue
            groups = match.groupdict()
            layer = int(groups["layer"]) if groups.get("layer") is not None else None
            expert = int(groups["e"]) if groups.get("e") is not None else None
            if layer is not None and not (
                layer < len(self.moe_layer_pattern)
                and (mapping.layers == "all" or self.moe_layer_pattern[layer] == (mapping.layers == "moe"))
            ):
                continue
            if expert is not None and expert >= self.num_experts:
                continue
            return self._resolve(mapping, layer, expert)
        return None

    def rules(self) -> Iterator[WeightRule]:
        """Every exported parameter's rule: non-layer mappings in order, then layer by layer, experts in order."""
        outer = [m for m in self.mappings if LAYER not in m.megatron]
        inner = [m for m in self.mappings if LAYER in m.megatron]
        for mapping in outer:
            yield self._resolve(mapping, None, None)
        for layer in range(len(self.moe_layer_pattern)):
            for mapping in inner:
                if layer not in self._layers(mapping):
                    continue
                experts = range(self.num_experts) if EXPERT in mapping.megatron else [None]
                for expert in experts:
                    yield self._resolve(mapping, layer, expert)

    def hf_names(self) -> set[str]:
        """Every HF tensor name the model uses (computed once)."""
        if self._hf_names is None:
            self._hf_names = {name for rule in self.rules() for name in rule.hf}
        return self._hf_names

    def build(
        self, rule: WeightRule, read: Callable[[str, int | None], torch.Tensor], rows: int | None = None
    ) -> torch.Tensor:
        """The full Megatron tensor from HF tensors; `read(name, expert_slot)`; `rows`: the padded vocabulary."""
        full = rule.to_megatron([read(name, rule.expert_slot) for name in rule.hf])
        if rule.vocab_padded and rows is not None and full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])
        return full

    def hf_tensor_builder(self, vocab_size: int) -> HFTensorBuilder:
        return HFTensorBuilder(self, vocab_size)


class HFTensorBuilder:
    """Full Megatron tensors in, finished HF tensors out: vocabulary padding cut, fused expert stacks assembled
    once all their experts have arrived (any order)."""

    def __init__(self, weights: WeightMap, vocab_size: int):
        self._weights, self._vocab = weights, vocab_size
        self._pending: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, rule: WeightRule, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if rule.vocab_padded:
            full = full[: self._vocab]
        parts = list(zip(rule.hf, rule.to_hf(full), strict=True))
        if rule.expert_slot is None:
            return parts
        done = []
        for name, part in parts:
            pending = self._pending.setdefault(name, {})
            pending[rule.expert_slot] = part
            if len(pending) == self._weights.num_experts:
                done.append((name, torch.stack([pending[e] for e in range(self._weights.num_experts)])))
                del self._pending[name]
        return done

    def check_finished(self) -> None:
        if self._pending:
            name, got = next(iter(self._pending.items()))
            raise RuntimeError(f"HF tensor {name} got {len(got)} of {self._weights.num_experts} experts")
