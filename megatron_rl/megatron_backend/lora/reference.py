"""The KL reference under LoRA: the policy RL starts from is the frozen base plus the adapters it starts with, so
the reference needs no copy of the model (`actor.reference.ReferenceWeights` keeps one on the host)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from megatron_rl.megatron_backend.lora.adapters import adapter_params, adapters_off
from megatron_rl.megatron_backend.lora.peft_format import load_peft_adapter


class AdapterReference:
    """`swapped_in()` as `ReferenceWeights` offers it: the actor computing as the starting policy. From scratch
    (every B = 0) that is the base with the adapters off: nothing is copied. When RL starts from trained adapters
    (`adapter_dir`: a supervised warm-up's, or `model.lora.init_from`, in peft's format) they are read from there,
    so a resumed run gets the same reference, and kept on the device (they are small) to swap with the current
    ones."""

    def __init__(self, actor: Any, options: Any, adapter_dir: Path | None = None):
        self._actor = actor
        self._kept: list[torch.Tensor] | None = None
        if adapter_dir is not None:
            params = self._params()
            current = [p.detach().clone() for p in params]
            load_peft_adapter(actor.chunks, options, actor.family.weight_map(actor.hf_config).num_experts, adapter_dir)
            self._kept = [p.detach().clone() for p in params]
            _copy(params, current)

    def _params(self) -> list[Any]:
        return adapter_params(self._actor.chunks)

    @property
    def host_bytes(self) -> int:
        return 0

    @contextmanager
    def swapped_in(self) -> Iterator[Any]:
        if self._kept is None:
            with adapters_off(self._actor.chunks):
                yield self._actor
            return
        params = self._params()
        current = [p.detach().clone() for p in params]
        try:
            _copy(params, self._kept)
            yield self._actor
        finally:
            _copy(params, current)


@torch.no_grad()
def _copy(params: list[Any], values: list[torch.Tensor]) -> None:
    for p, v in zip(params, values, strict=True):
        p.copy_(v)
