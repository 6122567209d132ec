"""Adapter-only checkpoints: the model part of a LoRA run's distributed checkpoint holds the adapters alone (the
frozen base is the HF checkpoint the run loads), each with its tensor-parallel split declared.

Megatron's linear layers declare their own `weight` and `bias` split (`make_sharded_tensors_for_checkpoint`) and
every other tensor of theirs, the adapters included, as replicated over tensor parallelism. An adapter that is
split (a column-parallel layer's B, a row-parallel layer's A; an expert's over expert tensor parallelism) gets
its axis, offset and fragment count here, so a checkpoint loads into any layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.options import LoRAOptions
from megatron_rl.megatron_backend.lora.adapters import LoRASlices, SharedExpertA, is_lora_param


def adapter_sharded_state_dict(chunk: Any, sharded: dict[str, Any]) -> dict[str, Any]:
    """The adapters' entries of `chunk`'s sharded state dict, each split as its parameter is."""
    from megatron.core import parallel_state as ps

    split = {}
    for module in chunk.modules():
        if not isinstance(module, LoRASlices | SharedExpertA):
            continue
        group = (
            (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
            if module.expert
            else (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
        )
        for param in module.parameters():
            if getattr(param, "tensor_model_parallel", False) and group[1] > 1:
                split[id(param)] = (int(param.partition_dim), *group)  # type: ignore[attr-defined]
    out = {}
    for key, entry in sharded.items():
        if not is_lora_param(key):
            continue
        if id(entry.data) in split:
            entry = _split(entry, *split[id(entry.data)])
        out[key] = entry
    return out


def _split(entry: Any, axis: int, rank: int, size: int) -> Any:
    """`entry` (declared replicated) as this rank's part `rank` of `size` along its tensor's `axis`."""
    dim = axis + entry.prepend_axis_num
    shape, offset, fragments = list(entry.global_shape), list(entry.global_offset), list(entry.axis_fragmentations)
    shape[dim] *= size
    offset[dim] += rank * entry.data.shape[axis]
    fragments[dim] = size
    replica = (entry.replica_id[0], 0, *entry.replica_id[2:]) if isinstance(entry.replica_id, tuple) else 0
    return dataclasses.replace(
        entry, global_shape=tuple(shape), global_offset=tuple(offset), axis_fragmentations=tuple(fragments),
        replica_id=replica,
    )  # fmt: skip


def load_adapter_state(chunk: Any, state: dict[str, Any]) -> None:
    """Load an adapter-only model state into `chunk`: every adapter must be in it, and nothing else."""
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if is_lora_param(k)]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"the checkpoint's adapters do not match this model's (model.lora): missing {missing[:3]}, unexpected "
            f"{list(result.unexpected_keys)[:3]}; resume with the model.lora settings that saved it"
        )


@dataclass(frozen=True)
class LoRARun:
    """What a LoRA checkpoint needs besides its adapters: the base model and the adapters' options."""

    base: Path
    lora: LoRAOptions


def lora_run(checkpoint: Path) -> LoRARun | None:
    """The LoRA settings of the run that wrote `checkpoint` (`<run>/checkpoints/step_*`), from its config.yaml;
    None when the run trained every weight (or the checkpoint is not a training run's)."""
    config = checkpoint.parent.parent / "config.yaml"
    if checkpoint.parent.name != "checkpoints" or not config.is_file():
        return None
    model = (yaml.safe_load(config.read_text()) or {}).get("model") or {}
    lora = model.get("lora") or {}
    if not lora.get("rank"):
        return None
    targets = tuple(lora.get("targets", LoRAOptions.targets))
    options = LoRAOptions(rank=int(lora["rank"]), alpha=float(lora.get("alpha", 16.0)), targets=targets,
                          share_expert_a=bool(lora.get("share_expert_a", False)))  # fmt: skip
    return LoRARun(Path(model["hf_path"]), options)
