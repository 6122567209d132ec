"""What a weight sync sends under LoRA: the merged weights of the adapted layers, the base, or the adapters alone.

* Merged (`rollout.lora_sync: merged`): the engine computes with `W + (α/r) B A`, which changes only on the adapted
  layers; once the engine holds the model, a sync needs only those tensors (`adapted_weights`). The set is derived
  from `model.lora.targets` and the family's weight map, never from what a rank holds: the export is collective and
  every rank must walk the same list.
* Adapter-only (`adapter`): an engine that serves LoRA itself takes the base once (`base_weights`, the adapters
  off) and then the adapters in peft's names (`adapter_payload`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_rl.config.options import LoRAOptions
from megatron_rl.megatron_backend.lora.adapters import _target, adapters_off
from megatron_rl.megatron_backend.lora.peft_format import adapter_config, peft_state_dict
from megatron_rl.models.mapping import WeightMap

Bucket = list[tuple[str, torch.Tensor]]


def adapted_weights(weights: WeightMap, options: LoRAOptions) -> frozenset[str]:
    """The global Megatron names of the weights the adapters of `options.targets` add to (the same on every rank)."""
    return frozenset(
        rule.megatron
        for rule in weights.rules()
        if rule.megatron.endswith(".weight") and _target(rule.megatron.removesuffix(".weight"), options.targets)
    )


def base_weights(actor: Any, bucket_bytes: int) -> Iterator[Bucket]:
    """Every HF tensor of the frozen base (the adapters off while the export runs). Collective."""
    with adapters_off(actor.chunks):
        yield from actor.export_hf(bucket_bytes=bucket_bytes)


def adapter_payload(actor: Any, base_model: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The adapters as peft names them (fp32) and their `adapter_config.json`, on rank 0 (None elsewhere).
    Collective."""
    state = peft_state_dict(actor.chunks, actor.family.weight_map(actor.hf_config).num_experts)
    return None if state is None else (state, adapter_config(actor.lora, state, base_model, for_peft=True))
