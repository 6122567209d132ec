"""The reference policy: the actor's architecture and parallel layout with frozen initial weights.

`ReferenceWeights`: this rank's shard of the reference weights lives in host memory
(pinned on GPU machines) and is swapped into the actor's own model for the reference pass, then the
actor's weights are swapped back — no second model on the device, cost = one copy of the rank's
parameters on the host plus two device<->host copies per reference pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor


class ReferenceWeights:
    """Host-resident copy of this rank's model shard, swapped into an actor on demand."""

    def __init__(self, actor: MegatronActor):
        self._actor = actor
        pin = platform.device().type == "cuda"
        self._host = [{name: _host_copy(p, pin) for name, p in module.named_parameters()} for module in actor.modules]

    @property
    def host_bytes(self) -> int:
        """Host memory held by the reference shard on this rank."""
        return sum(t.numel() * t.element_size() for state in self._host for t in state.values())

    @contextmanager
    def swapped_in(self) -> Iterator[MegatronActor]:
        """Within the block the actor computes with the reference weights; its own come back afterwards.

        The actor's weights are parked on the host meanwhile, so the device never holds both.
        """
        modules = self._actor.modules
        parked = [{name: _host_copy(p, False) for name, p in m.named_parameters()} for m in modules]
        try:
            _copy_into(modules, self._host)
            yield self._actor
        finally:
            _copy_into(modules, parked)


def reference_from_hf(actor: MegatronActor, model_dir: str | Path) -> ReferenceWeights:
    """Reference weights read from an HF checkpoint (e.g. the policy after the warm-up stage), captured
    on the host while the actor's own weights are parked and then put back."""
    modules = actor.modules
    parked = [{name: _host_copy(p, False) for name, p in m.named_parameters()} for m in modules]
    actor.load_hf(model_dir)
    reference = ReferenceWeights(actor)
    _copy_into(modules, parked)
    if actor.optimizer is not None:
        actor.reload_main_params()
    return reference


def _host_copy(param: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = platform.empty_host(param.shape, param.dtype, pinned=pin)
    copy.copy_(param.detach(), non_blocking=False)
    return copy


@torch.no_grad()
def _copy_into(modules: list[torch.nn.Module], states: list[dict[str, torch.Tensor]]) -> None:
    for module, state in zip(modules, states, strict=True):
        for name, param in module.named_parameters():
            param.copy_(state[name], non_blocking=True)
    platform.synchronize()
