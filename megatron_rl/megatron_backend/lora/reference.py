"""The KL reference under LoRA: the policy RL starts from is the frozen base plus the adapters it starts with, so
the reference needs no copy of the model (`actor.reference.ReferenceWeights` keeps one on the host)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_rl.megatron_backend.lora.adapters import adapters_off, lora_modules


class AdapterReference:
    """`swapped_in()` as `ReferenceWeights` offers it: the actor computing as the starting policy. From scratch
    (every B = 0) that is the base with the adapters off: nothing is copied. After a supervised warm-up the
    adapters it trained are kept (on the device: they are small) and swapped with the current ones."""

    def __init__(self, actor: Any, *, from_warmup: bool):
        self._actor = actor
        params = [p for lora in lora_modules(actor.chunks) for p in lora.parameters()]
        self._kept = [p.detach().clone() for p in params] if from_warmup else None

    @property
    def host_bytes(self) -> int:
        return 0

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._kept or [])

    @contextmanager
    def swapped_in(self) -> Iterator[Any]:
        if self._kept is None:
            with adapters_off(self._actor.chunks):
                yield self._actor
            return
        params = [p for lora in lora_modules(self._actor.chunks) for p in lora.parameters()]
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
