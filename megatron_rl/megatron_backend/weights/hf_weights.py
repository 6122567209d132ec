"""Hugging Face <-> Megatron weights for tensor/expert/pipeline(-virtual) parallel models.

Loading: each rank reads from the safetensors files only the HF tensors behind the parameters it
holds, builds the full Megatron tensor with the family's rule and keeps its own shard.
Export: the one streaming path that weight sync and checkpoint conversion reuse. Every rank walks
the same global list of parameters; the tensor-parallel peers gather a shard, the lowest rank that
holds the parameter broadcasts it, and HF-named full tensors are yielded in buckets of a bounded size.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.formats.safetensors_files import safetensors_weight_map
from megatron_rl.models.family import HFConfig, ModelFamily, UnsupportedModelError, WeightMismatchError
from megatron_rl.models.mapping import WeightMap, WeightRule, canonical_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass
class LocalParam:
    """A parameter (or mapped buffer) of this rank's model chunks with its global, HF-independent identity."""

    global_name: str
    param: torch.Tensor
    is_expert: bool
    adapter: Any = None  # the LoRA adapters of the layer this weight belongs to (`lora.adapters.LoRASlices`)

    def value(self) -> torch.Tensor:
        """The weight the layer computes with: the parameter, plus its adapters' `(α/r) B A` under LoRA (merged)."""
        param = self.param.detach()
        if self.adapter is None or not self.adapter.enabled:
            return param
        return (param.float() + self.adapter.delta_weight().detach()).to(param.dtype)


def _rank_info() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )


def global_name(model: Any, name: str, num_experts: int) -> str:
    """A parameter's layout-free name: `name` (of the bare model `model`) with its global layer and global expert
    index (the canonical, local-spec spelling)."""
    from megatron.core import parallel_state as ps

    name = canonical_name(name)
    layer_match = _LAYER.match(name)
    if layer_match:
        global_layer = model.decoder.layers[int(layer_match.group(1))].layer_number - 1
        name = f"decoder.layers.{global_layer}." + name[layer_match.end() :]
    expert_match = _EXPERT.search(name)
    if expert_match:
        local_experts = num_experts // ps.get_expert_model_parallel_world_size()
        global_expert = ps.get_expert_model_parallel_rank() * local_experts + int(expert_match.group(1))
        expert = f".mlp.experts.local_experts.{global_expert}."
        name = name[: expert_match.start()] + expert + name[expert_match.end() :]
    return name


def local_params(chunks: list[nn.Module], weights: WeightMap) -> list[LocalParam]:
    """This rank's parameters, and the buffers a mapping covers (a router's expert bias), named by global layer and
    global expert index; LoRA adapters are not among them, they ride with their layer's weight (`LocalParam`), nor
    parameters marked `not_in_hf_map` (the critic's value head)."""
    from megatron_rl.megatron_backend.lora.adapters import is_lora_param

    out: list[LocalParam] = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        modules = dict(model.named_modules())
        tensors = [
            (n, t, True) for n, t in model.named_parameters()
            if not is_lora_param(n) and not getattr(t, "not_in_hf_map", False)  # a critic's value head
        ]  # fmt: skip
        tensors += [(n, t, False) for n, t in model.named_buffers()]
        for local, param, is_param in tensors:
            name = global_name(model, local, weights.num_experts)
            if is_param or weights.rule(name) is not None:
                owner, _, leaf = local.rpartition(".")
                adapter = getattr(modules.get(owner), "lora", None) if leaf == "weight" else None
                out.append(LocalParam(name, param, is_expert=_EXPERT.search(name) is not None, adapter=adapter))
    return out


def unwrap_model(module: nn.Module) -> Any:
    """The bare model (a Megatron GPTModel) inside Megatron's DDP / Float16Module wrappers.

    Any: nn.Module's stub types every attribute as Tensor | Module, and callers use the GPTModel's own.
    """
    model: Any = module
    while hasattr(model, "module"):
        model = model.module
    return model


def _tp_sharded(param: torch.Tensor) -> bool:
    """Whether Megatron splits `param` across tensor-parallel ranks (an attribute Megatron sets on the parameter)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _partition_dim(param: torch.Tensor) -> int:
    """The dimension Megatron splits a tensor-parallel parameter along (set together with `tensor_model_parallel`)."""
    megatron_param: Any = param  # torch's stub does not know the attributes Megatron adds
    return int(megatron_param.partition_dim)


def _shard(full: torch.Tensor, param: torch.Tensor, rule: WeightRule, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of the full Megatron tensor, following Megatron's partitioning of `param`."""
    if size == 1 or not _tp_sharded(param):
        return full
    dim = _partition_dim(param)
    if rule.glu:  # [gate; up] -> [gate_r; up_r]
        return torch.cat([half.chunk(size, dim=dim)[rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(size, dim=dim)[rank]


def tp_shard(full: torch.Tensor, param: torch.Tensor, rule: WeightRule, *, expert: bool = False) -> torch.Tensor:
    """This rank's slice of the full Megatron tensor of `param` (split over the expert tensor-parallel group for a
    routed expert's)."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size, etp_rank, _ = _rank_info()
    if expert:
        return _shard(full, param, rule, etp_rank, ps.get_expert_tensor_parallel_world_size())
    return _shard(full, param, rule, tp_rank, tp_size)


class SafetensorsIndex:
    """Lazy, per-tensor access to the safetensors files of an HF model directory."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self._dir = model_dir
        self._map = safetensors_weight_map(model_dir)  # every file's header checked: truncation is named here
        self._open = safe_open
        self._handles: dict[str, Any] = {}  # open safetensors files (safe_open handles)

    def get(self, name: str, expert_slot: int | None = None) -> torch.Tensor:
        """The tensor, or only row `expert_slot` of a tensor that stacks all experts (nothing else is read)."""
        handle = self._handle(name)
        if expert_slot is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[expert_slot : expert_slot + 1][0]

    def _handle(self, name: str) -> Any:
        if name not in self._map:
            raise WeightMismatchError(f"checkpoint has no tensor {name!r}: is it a checkpoint of this architecture?")
        file = self._map[name]
        if file not in self._handles:
            self._handles[file] = self._open(self._dir / file, "pt")
        return self._handles[file]

    def names(self) -> set[str]:
        return set(self._map)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from the file header (nothing is read)."""
        return tuple(self._handle(name).get_slice(name).get_shape())


def unused_checkpoint_tensors(
    family: ModelFamily, hf: HFConfig, weights: WeightMap, names: set[str], where: str | Path
) -> dict[str, list[str]]:
    """Checkpoint tensors the model does not use, by the family's reason (MTP layers); anything else is refused."""
    skipped: dict[str, list[str]] = {}
    unexpected = []
    for name in sorted(names - weights.hf_names()):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        reason = family.unused_tensor_reason(name, hf)
        if reason is None:
            unexpected.append(name)
        else:
            skipped.setdefault(reason, []).append(name)
    if unexpected:
        raise WeightMismatchError(
            f"checkpoint {where} has {len(unexpected)} tensors this {family.model_type} config does not use, "
            f"e.g. {unexpected[:3]}: the checkpoint and config.json describe different architectures"
        )
    return skipped


@torch.no_grad()
def load_hf_weights(
    chunks: list[nn.Module], model_dir: str | Path, family: ModelFamily, hf: HFConfig, *,
    also_present: frozenset[str] = frozenset(),
) -> None:  # fmt: skip
    """Fill this rank's shards of `chunks` from an HF checkpoint directory (each rank reads only its tensors).

    Tensors the family marks unused (MTP layers) are skipped and named on stderr by rank 0; `also_present` names
    tensors the caller reads or ignores itself (a critic's score head and the unused LM head).
    """
    model_dir = Path(model_dir)
    weights = family.weight_map(hf)
    index = SafetensorsIndex(model_dir)
    skipped = unused_checkpoint_tensors(family, hf, weights, index.names() - also_present, model_dir)
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        for reason, names in skipped.items():
            print(f"[megatron-rl] skipped {len(names)} checkpoint tensors ({reason}): {names[:4]}", file=sys.stderr)
    tp_rank, tp_size, etp_rank, _ = _rank_info()
    from megatron.core import parallel_state as ps

    etp_size = ps.get_expert_tensor_parallel_world_size()
    for item in local_params(chunks, weights):
        rule = weights.rule(item.global_name)
        if rule is None:
            raise WeightMismatchError(f"no HF weight rule for Megatron parameter {item.global_name!r}")
        rows = item.param.shape[0] * (tp_size if _tp_sharded(item.param) else 1)
        full = weights.build(rule, index.get, rows)
        rank, size = (etp_rank, etp_size) if item.is_expert else (tp_rank, tp_size)
        shard = _shard(full, item.param, rule, rank, size)
        if shard.shape != item.param.shape:
            raise WeightMismatchError(
                f"{rule.hf} -> {item.global_name}: checkpoint gives shape {tuple(shard.shape)} for this rank but the "
                f"model built from config.json expects {tuple(item.param.shape)}; the checkpoint does not match "
                "the config"
            )
        item.param.copy_(shard.to(item.param.dtype))


def _gather_full(item: LocalParam, rule: WeightRule) -> torch.Tensor:
    """Reassemble the full Megatron tensor from the tensor-parallel shards (collective over the TP group)."""
    from megatron.core import parallel_state as ps

    param = item.value()
    if item.is_expert:
        group, size = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
    else:
        group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    if size == 1 or not _tp_sharded(item.param):
        return param
    parts = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(parts, param.contiguous(), group=group)
    dim = _partition_dim(item.param)
    if rule.glu:
        gates = [p.chunk(2, dim=0)[0] for p in parts]
        ups = [p.chunk(2, dim=0)[1] for p in parts]
        return torch.cat([torch.cat(gates, dim=dim), torch.cat(ups, dim=dim)], dim=0)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def export_hf_weights(
    chunks: list[nn.Module],
    family: ModelFamily,
    hf: HFConfig,
    *,
    bucket_bytes: int = 512 << 20,
    dtype: torch.dtype | None = None,
    only: Collection[str] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the model's weights as HF-named full tensors, in buckets of at most `bucket_bytes` (or one tensor).

    Collective: every rank of the job must iterate the generator to the end. Every rank receives every
    tensor (P3's weight sync and P7's converter then decide which rank writes or sends it). `only`: the global
    Megatron names to export (the same set on every rank, e.g. `lora.sync_payload.adapted_weights`); None = all.
    """
    dims = family.dims(hf)
    weights = family.weight_map(hf)
    mine = {item.global_name: item for item in local_params(chunks, weights)}
    if dims.tie_word_embeddings:
        mine.pop("output_layer.weight", None)
    ordered = [rule for rule in weights.rules() if only is None or rule.megatron in only]
    owners = _owners([rule.megatron for rule in ordered], mine)
    rank = dist.get_rank() if dist.is_initialized() else 0
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    builder = weights.hf_tensor_builder(dims.vocab_size)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for rule in ordered:
        name = rule.megatron
        full = _gather_full(mine[name], rule) if name in mine else None  # collective over its TP group
        owner, shape, param_dtype = owners[name]
        if distributed and rank != owner:
            full = torch.empty(shape, dtype=param_dtype)
        if full is None:  # `_owners` found a holder for every parameter, and the owner holds it
            raise RuntimeError(f"rank {rank} neither holds nor receives {name!r}")
        if distributed:
            dist.broadcast(full.contiguous() if rank == owner else full, src=owner)
        for hf_name, tensor in builder.add(rule, full):
            tensor = tensor.to(dtype) if dtype is not None else tensor
            bucket.append((hf_name, tensor.contiguous()))
            size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    builder.check_finished()
    if bucket:
        yield bucket


def _full_shape(item: LocalParam) -> tuple[int, ...]:
    from megatron.core import parallel_state as ps

    shape = list(item.param.shape)
    if _tp_sharded(item.param):
        size = (
            ps.get_expert_tensor_parallel_world_size() if item.is_expert else ps.get_tensor_model_parallel_world_size()
        )
        shape[_partition_dim(item.param)] *= size
    return tuple(shape)


def _owners(ordered: list[str], mine: dict[str, LocalParam]) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
    """For each parameter: the lowest global rank holding it, its full shape and dtype (one collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        held: list = [None] * dist.get_world_size()
        dist.all_gather_object(held, {n: (_full_shape(p), p.param.dtype) for n, p in mine.items()})
    else:
        held = [{n: (_full_shape(p), p.param.dtype) for n, p in mine.items()}]
    owners: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for rank, names in enumerate(held):
        for name, (shape, dtype) in names.items():
            owners.setdefault(name, (rank, shape, dtype))
    missing = [n for n in ordered if n not in owners]
    if missing:
        raise UnsupportedModelError(f"no rank holds parameters {missing[:3]} expected by the weight rules")
    return owners
