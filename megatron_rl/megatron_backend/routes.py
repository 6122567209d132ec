"""Per-model access to Megatron's MoE routers: record the experts each token was routed to.

Megatron-Core's `RouterReplay` keeps a process-global list of instances; we never use it. Each
`MoERouters` object binds to the routers of one model (so a reference model or a second copy in
the same process cannot disturb it) and drives their `RouterReplay` instances directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def _unwrap(module: nn.Module) -> nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


@dataclass
class RouterHandle:
    global_layer: int
    chunk: int
    router: nn.Module


class MoERouters:
    """The MoE routers of one model's chunks on this rank, ordered by global layer index."""

    def __init__(self, chunks: list[nn.Module]):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        handles: list[RouterHandle] = []
        for chunk_index, chunk in enumerate(chunks):
            for layer in _unwrap(chunk).decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    if getattr(router, "router_replay", None) is None:
                        raise ValueError("model was built without moe_enable_routing_replay; cannot record routes")
                    handles.append(RouterHandle(layer.layer_number - 1, chunk_index, router))
        self.handles = sorted(handles, key=lambda h: h.global_layer)
        # Drop our instances from Megatron's process-global registry: we address them directly, and
        # the registry would otherwise keep every model ever built alive.
        mine = {id(h.router.router_replay) for h in self.handles}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
        ]

    @property
    def layers(self) -> list[int]:
        return [h.global_layer for h in self.handles]

    def set_action(self, action: str | None, *, chunk: int | None = None) -> None:
        """`record`, `replay_forward`, `replay_backward` or None (natural routing) for every router
        (or only those of model chunk `chunk`)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        value = None if action is None else RouterReplayAction(action)
        for h in self.handles:
            if chunk is None or h.chunk == chunk:
                h.router.router_replay.router_replay_action = value

    def unconsumed(self) -> list[int]:
        """Layers whose replay queue still holds routes (each recorded route must be used exactly once)."""
        return [h.global_layer for h in self.handles if h.router.router_replay.replay_backward_list]

    def take_recorded(self, chunk: int) -> list[torch.Tensor]:
        """The top-k indices each router of model chunk `chunk` recorded in its last forward,
        `[tokens_local, top_k]` each, in global layer order."""
        out = []
        for h in self.handles:
            if h.chunk != chunk:
                continue
            idx = h.router.router_replay.recorded_topk_idx
            if idx is None:
                raise RuntimeError(f"router of layer {h.global_layer} recorded nothing in the last forward")
            out.append(idx.detach().clone())
            h.router.router_replay.recorded_topk_idx = None
        return out

    def clear(self) -> None:
        for h in self.handles:
            h.router.router_replay.clear_indices()
