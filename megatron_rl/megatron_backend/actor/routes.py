"""Per-model access to Megatron's MoE routers: record the experts each token was routed to.

Megatron-Core's `RouterReplay` keeps a process-global list of instances; we never use it. Each
`MoERouters` object binds to the routers of one model (so a reference model or a second copy in
the same process cannot disturb it) and drives their `RouterReplay` instances directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_rl.megatron_backend.weights.hf_weights import unwrap_model


@dataclass
class RouterHandle:
    global_layer: int
    chunk: int
    router: Any  # Megatron's TopKRouter; nn.Module's stub types its attributes as Tensor | Module


class MoERouters:
    """The MoE routers of one model's chunks on this rank, ordered by global layer index."""

    def __init__(self, chunks: list[nn.Module]):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        handles: list[RouterHandle] = []
        for chunk_index, chunk in enumerate(chunks):
            model: Any = unwrap_model(chunk)  # a GPTModel
            for layer in model.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    if getattr(router, "router_replay", None) is None:
                        raise ValueError("model was built without moe_enable_routing_replay; cannot record routes")
                    handles.append(RouterHandle(layer.layer_number - 1, chunk_index, router))
        self.handles = sorted(handles, key=lambda h: h.global_layer)
        replay_class = _fixed_rows_replay_class()
        for h in self.handles:
            if not isinstance(h.router.router_replay, replay_class):
                h.router.router_replay = replay_class()
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

    def set_fixed_rows(self, rows: torch.Tensor | None, *, chunk: int) -> None:
        """Route the tokens where `rows` (`[tokens_local]` bool, Megatron's order) is True to experts 0..k-1 when
        routing naturally or recording, as a replay routes positions without a recorded route. For the trailing
        padding of a packed row: the experts' GEMMs are not independent of the other tokens they get, so natural,
        recorded and replayed passes over a micro-batch agree bitwise only if its padding routes alike in all.
        None: route every token naturally."""
        for h in self.handles:
            if h.chunk == chunk:
                h.router.router_replay.fixed_rows = rows

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


@functools.cache
def _fixed_rows_replay_class() -> type:
    """Megatron's `RouterReplay` that, when routing naturally or recording, routes the tokens marked in
    `fixed_rows` to experts 0..k-1 (their probabilities gathered from the scores, as a replay does)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class FixedRowsRouterReplay(RouterReplay):
        fixed_rows: torch.Tensor | None = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, indices = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            action = self.router_replay_action
            if action not in (None, RouterReplayAction.RECORD) or self.fixed_rows is None:
                return probs, indices
            rows = self.fixed_rows.to(scores.device).unsqueeze(1)
            indices = torch.where(rows, torch.arange(topk, device=scores.device), indices)
            probs = torch.where(rows, scores.gather(1, indices), probs)
            if action == RouterReplayAction.RECORD:
                self.record_indices(indices)
            return probs, indices

    return FixedRowsRouterReplay


class ReplayMonitor:
    """Forward hooks on one model's routers while routes are replayed.

    For every router call it counts forwards and recomputes for the exactly-once check; with `check` it
    checks that the routing Megatron used (`routing_map`) is the replayed one (the target in forward; in
    activation recompute, the routing that forward used), counting mismatches on the device without a host
    sync; with `measure` it compares the replayed routes with
    the routes the current weights would choose naturally (top-k of the router's own logits, recomputed
    under no_grad from the router's input: one small matmul per MoE layer).
    """

    def __init__(self, routers: MoERouters, moe_layers: list[int], *, check: bool = True, measure: bool):
        from megatron_rl.routing.agreement import AgreementCounts

        self.routers, self.moe_layers, self.check, self.measure = routers, moe_layers, check, measure
        self.valid: torch.Tensor | None = None  # [tokens_local] bool for the micro-batch being run
        self._valid_on_device: torch.Tensor | None = None
        self.disagree: dict[int, list[torch.Tensor]] = {}  # chunk -> per micro-batch [tokens_local] counts
        self.valid_of: dict[int, list[torch.Tensor]] = {}
        self.counts = AgreementCounts.zeros(len(moe_layers))
        self._forwards = {h.global_layer: 0 for h in routers.handles}
        self._recomputes = dict.fromkeys(self._forwards, 0)
        self._mismatched: dict[int, torch.Tensor | int] = dict.fromkeys(self._forwards, 0)  # device counts
        self._used: dict[int, list[torch.Tensor]] = {layer: [] for layer in self._forwards}
        self._hooks = [h.router.register_forward_hook(self._hook(h)) for h in routers.handles]

    def begin_micro_batch(self, chunk: int, valid: torch.Tensor) -> None:
        """Called before each replayed forward of model chunk `chunk` with its tokens' validity (Megatron order)."""
        self.valid = valid.reshape(-1).bool()
        self._valid_on_device = None
        self.valid_of.setdefault(chunk, []).append(self.valid)
        self.disagree.setdefault(chunk, []).append(torch.zeros(self.valid.numel(), dtype=torch.int32))

    def _hook(self, handle: RouterHandle):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def hook(router: Any, inputs: tuple, output: tuple) -> None:
            replay = router.router_replay
            action = replay.router_replay_action
            if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
                return
            with torch.no_grad():
                layer = handle.global_layer
                backward = action == RouterReplayAction.REPLAY_BACKWARD
                if backward:
                    self._recomputes[layer] += 1
                else:
                    self._forwards[layer] += 1
                if self.check:
                    self._check(router, layer, output[1], backward)
                if self.measure and not backward:
                    self._measure(router, handle, inputs[0], replay.target_topk_idx.sort(-1).values)

        return hook

    def _check(self, router: Any, layer: int, routing_map: torch.Tensor, backward: bool) -> None:
        """Count (on the device, no host sync) a call whose routing differs from the replayed target (forward:
        at the real tokens) or from what the same micro-batch's forward used (activation recompute)."""
        used = routing_map.float().topk(router.topk, dim=-1).indices.sort(-1).values
        if backward:
            expected = self._used[layer].pop(0) if self._used[layer] else None
            if expected is None or expected.shape != used.shape:
                self._mismatched[layer] += 1
            else:
                self._mismatched[layer] = self._mismatched[layer] + (expected != used).any().int()
            return
        target = router.router_replay.target_topk_idx.sort(-1).values
        if self._valid_on_device is None:
            valid = self.valid if self.valid is not None else torch.ones(target.shape[0], dtype=torch.bool)
            self._valid_on_device = valid.to(target.device)
        wrong = ((target != used).any(-1) & self._valid_on_device).any()
        self._mismatched[layer] = self._mismatched[layer] + wrong.int()
        self._used[layer].append(used)

    def _measure(self, router: Any, handle: RouterHandle, hidden: torch.Tensor, replayed: torch.Tensor) -> None:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        from megatron_rl.routing.agreement import slot_matches

        logits = router.gating(hidden).view(-1, router.config.num_moe_experts)
        _, natural_map = topk_routing_with_score_function(
            logits,
            router.topk,
            use_pre_softmax=router.config.moe_router_pre_softmax,
            num_groups=router.config.moe_router_num_groups,
            group_topk=router.config.moe_router_group_topk,
            scaling_factor=router.config.moe_router_topk_scaling_factor,
            score_function=router.score_function,
            expert_bias=router.expert_bias,
        )
        natural = natural_map.float().topk(router.topk, dim=-1).indices.cpu()
        matches = slot_matches(replayed.cpu(), natural)  # [tokens_local]
        valid = self.valid
        if valid is None:
            raise RuntimeError("measuring route agreement needs begin_micro_batch before each replayed forward")
        column = self.moe_layers.index(handle.global_layer)
        self.counts.matches[column] += float(matches[valid].sum())
        self.counts.slots[column] += float(valid.sum()) * router.topk
        self.disagree[handle.chunk][-1] += (matches != router.topk).to(torch.int32)

    def uses(self) -> list:
        from megatron_rl.routing.replay import RouterUse

        return [
            RouterUse(
                h.global_layer,
                self._forwards[h.global_layer],
                self._recomputes[h.global_layer],
                len(h.router.router_replay.replay_backward_list),
                int(self._mismatched[h.global_layer]),
            )
            for h in self.routers.handles
        ]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
