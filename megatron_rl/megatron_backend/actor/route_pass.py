"""Routing during one run of Megatron's schedule: record the experts the routers choose, or replay given ones.

`RoutePass(actor_parts, mode)` wraps a forward(-backward) schedule over micro-batches:
`before_forward` / `after_forward` around each model-chunk forward, `close()` in a `finally`, then `finish()`.
- `record`: the routers' top-k of every MoE layer, assembled to `[rows, seq, moe_layers, top_k]` over
  pipeline stages and sequence-parallel slices.
- `replay`: each router is handed the experts of `mb.routes` (Megatron's token order); a `ReplayMonitor`
  checks every router call routes as replayed and that each micro-batch's routes are consumed exactly once
  (`routing.replay.check_consumed`), and measures the agreement of the replayed routes with the routes the
  current weights would choose (`routing.agreement`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.actor.routes import MoERouters, ReplayMonitor
from megatron_rl.models.family import ModelDims
from megatron_rl.parallel_layout import ParallelLayout
from megatron_rl.routing.agreement import RouteAgreement
from megatron_rl.routing.cache import routes_dtype
from megatron_rl.routing.replay import FULL_CHECKS, ReplayChecks

RouteMode = Literal["record", "replay"] | None


class RoutePass:
    """Record or replay routes for one schedule run of one model (see the module docstring)."""

    def __init__(
        self,
        mode: RouteMode,
        routers: MoERouters,
        modules: list[Any],
        dims: ModelDims,
        layout: ParallelLayout,
        *,
        micro_batches: list[TokenBatch],
        groups: dict,
        checks: ReplayChecks = FULL_CHECKS,
    ):
        if mode not in ("record", "replay", None):
            raise ValueError(f"route mode {mode!r}: expected 'record', 'replay' or None")
        if mode == "replay" and any(mb.routes is None for mb in micro_batches):
            raise ValueError("replaying routes needs batch.routes")
        self.mode, self.routers, self.modules, self.dims, self.layout = mode, routers, modules, dims, layout
        self.micro_batches, self.groups = micro_batches, groups
        self.recorded: list[list[list[torch.Tensor]]] = [[] for _ in modules]  # [chunk][micro-batch][layer]
        self.checks = checks
        watch = mode == "replay" and (checks.check or checks.agreement)
        self.monitor = (
            ReplayMonitor(routers, dims.moe_layers, check=checks.check, measure=checks.agreement) if watch else None
        )
        self._targets_only = mode == "replay" and not watch
        if mode == "record":
            routers.set_action("record")

    def before_forward(self, mb: TokenBatch, chunk: int) -> None:
        self.routers.set_fixed_rows(self._packed_padding(mb), chunk=chunk)
        if self.monitor is not None:
            self.monitor.begin_micro_batch(chunk, self._set_replay_targets(mb, chunk))
        elif self._targets_only:
            self._set_replay_targets(mb, chunk)
        if self.mode == "replay":
            self.routers.set_action("replay_forward", chunk=chunk)

    def after_forward(self, chunk: int, *, forward_only: bool) -> None:
        if self.mode == "replay" and not forward_only:
            # Activation recompute re-runs this forward during backward: it pops the same routes.
            self.routers.set_action("replay_backward", chunk=chunk)
        if self.mode == "record":
            self.recorded[chunk].append(self.routers.take_recorded(chunk))

    def close(self) -> list:
        """Leave the routers natural again; return the replay monitor's router uses (empty unless replaying)."""
        uses = self.monitor.uses() if self.monitor is not None else []
        if self.monitor is not None:
            self.monitor.remove()
        for chunk in range(len(self.modules)):
            self.routers.set_fixed_rows(None, chunk=chunk)
        if self.mode is not None:
            self.routers.set_action(None)
            self.routers.clear()
        return uses

    def finish(self, uses: list, *, recompute: bool, seq_len: int) -> tuple[torch.Tensor | None, RouteAgreement | None]:
        """`(recorded routes [rows, seq_len, moe_layers, top_k] or None, replay agreement or None)`. Collective."""
        from megatron_rl.routing.replay import check_consumed

        if self.monitor is not None:
            if self.checks.check:
                check_consumed(uses, len(self.micro_batches), recompute=recompute)
            return None, self._reduce_agreement(self.monitor) if self.checks.agreement else None
        if self.mode == "record":
            per_mb = [
                [t for chunk in range(len(self.modules)) for t in self.recorded[chunk][m]]
                for m in range(len(self.micro_batches))
            ]
            return self._assemble_routes(per_mb, seq_len), None
        return None, None

    # ------------------------------------------------------------------ replay
    def _set_replay_targets(self, mb: TokenBatch, chunk: int) -> torch.Tensor:
        """Hand each router of `chunk` the experts to use for this micro-batch, in Megatron's token order;
        return which of those tokens carry real routes (`[s_local * b]` bool, same order).

        Megatron flattens hidden states `[s, b]` s-major; with sequence parallelism each tensor-parallel rank
        holds a contiguous slice of the sequence. Real routes: positions t < length - 1 of real rows (the last
        token has no route in SGLang's layout and feeds no log-prob). Rows with a repeated expert (recorded
        padding reads 0) get experts 0..k-1: what a recording routes padding to, so a replayed re-run of the
        recorded micro-batches is bitwise identical to the recording.
        """
        routes = mb.routes  # [b, s, moe_layers, k]
        if routes is None:
            raise ValueError("replaying routes needs batch.routes")
        k = routes.shape[-1]
        valid = torch.arange(routes.shape[1]).unsqueeze(0) < (mb.lengths.unsqueeze(1) - 1)
        if mb.padding_rows:
            valid[-mb.padding_rows :] = False
        if mb.packing is not None:  # the packed row's order; its trailing padding routes like recorded padding
            routes, valid = mb.packing.pack(routes), mb.packing.pack(valid, fill=False)
        sorted_routes = routes.sort(-1).values
        repeated = (sorted_routes[..., 1:] == sorted_routes[..., :-1]).any(-1, keepdim=True)
        routes = torch.where(repeated, torch.arange(k, dtype=routes.dtype), routes)
        tp, tp_rank = self._sequence_parallel_slice()
        if tp > 1:
            routes, valid = routes.chunk(tp, dim=1)[tp_rank], valid.chunk(tp, dim=1)[tp_rank]
        layers_of_chunk = {layer.layer_number - 1 for layer in self.modules[chunk].decoder.layers}
        for handle in self.routers.handles:
            if handle.global_layer in layers_of_chunk:
                column = self.dims.moe_layers.index(handle.global_layer)
                target = routes[:, :, column].transpose(0, 1).reshape(-1, k).long().to(platform.device())
                handle.router.router_replay.set_target_indices(target)
        return valid.transpose(0, 1).reshape(-1)

    def _packed_padding(self, mb: TokenBatch) -> torch.Tensor | None:
        """`[tokens_local]` bool, Megatron's order: the trailing padding of a packed row (None if it has none)."""
        if mb.packing is None or mb.packing.total == mb.packing.used:
            return None
        padding = mb.packing.pack(torch.zeros(mb.input_ids.shape, dtype=torch.bool), fill=True)
        tp, tp_rank = self._sequence_parallel_slice()
        return padding.chunk(tp, dim=1)[tp_rank].transpose(0, 1).reshape(-1)

    def _sequence_parallel_slice(self) -> tuple[int, int]:
        """(number of sequence slices, this rank's slice): (1, 0) without sequence parallelism."""
        from megatron.core import parallel_state as ps

        if not self.layout.sequence_parallel or ps.get_tensor_model_parallel_world_size() == 1:
            return 1, 0
        return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()

    def _reduce_agreement(self, monitor: ReplayMonitor) -> RouteAgreement:
        """Replayed-vs-natural route agreement over the whole run (all layers, stages and ranks)."""
        from megatron.core import parallel_state as ps

        from megatron_rl.routing.agreement import AgreementCounts

        count = len(self.micro_batches)
        chunks = sorted(monitor.disagree)
        disagree = torch.cat([torch.stack([monitor.disagree[c][m] for c in chunks]).sum(0) for m in range(count)])
        valid = torch.cat([monitor.valid_of[chunks[0]][m] for m in range(count)])
        per_layer = torch.cat([monitor.counts.matches, monitor.counts.slots])
        if ps.get_pipeline_model_parallel_world_size() > 1:  # same tokens, other layers on each stage
            dist.all_reduce(disagree, group=self.groups["pp"])
            dist.all_reduce(per_layer, group=self.groups["pp"])
        tokens = torch.tensor([float(((disagree == 0) & valid).sum()), float(valid.sum())], dtype=torch.float64)
        vec = torch.cat([per_layer, tokens])
        dist.all_reduce(vec, group=self.groups["dp"])  # other samples
        if self._sequence_parallel_slice()[0] > 1:
            dist.all_reduce(vec, group=self.groups["tp"])  # other sequence slices
        return AgreementCounts.from_tensor(vec).result()

    # ------------------------------------------------------------------ record
    def _assemble_routes(self, recorded: list[list[torch.Tensor]], s: int) -> torch.Tensor:
        """[shard_batch, s, moe_layers, top_k] from per-micro-batch, per-local-layer [s_local*b, k] records."""
        from megatron.core import parallel_state as ps

        k = self.dims.top_k
        dtype = routes_dtype(self.dims.num_experts)
        tp = self._sequence_parallel_slice()[0]
        per_mb = []
        for mb, layers in zip(self.micro_batches, recorded, strict=True):
            b = 1 if mb.packing is not None else mb.input_ids.shape[0]
            stacked = torch.stack([t.view(-1, b, k) for t in layers], dim=2) if layers else torch.empty(0)
            if tp > 1 and layers:
                parts = [torch.empty_like(stacked) for _ in range(tp)]
                dist.all_gather(parts, stacked.contiguous(), group=self.groups["tp"])
                stacked = torch.cat(parts, dim=0)
            # [b, s_mb, L_local, k] per sample
            per_mb.append(mb.per_sample(stacked.permute(1, 0, 2, 3).to(dtype).cpu()) if layers else None)
        # Collect the layers of every pipeline stage.
        local = (self.routers.layers, per_mb)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(gathered, local, group=self.groups["pp"])
        else:
            gathered = [local]
        order = sorted(
            (layer, stage, j) for stage, (layers, _) in enumerate(gathered) for j, layer in enumerate(layers)
        )
        total = sum(mb.size - mb.padding_rows for mb in self.micro_batches)
        out = torch.zeros(total, s, len(order), k, dtype=dtype)
        row = 0
        for m, mb in enumerate(self.micro_batches):
            n, w = mb.size - mb.padding_rows, min(mb.input_ids.shape[1], s)
            for col, (_, stage, j) in enumerate(order):
                out[row : row + n, :w, col] = gathered[stage][1][m][:n, :w, j]
            row += n
        return out
