"""Routing replay over one RL step: the routes of the samples this data-parallel rank feeds.

R2 records the routes in the old-policy pass and replays them in every update; R3 replays the rollout
engine's routes in the old-policy pass and in every update (`routing.replay`). `StepRoutes` keeps them in a
compact host `RouteCache` and is used by the step in four places:

    routes = StepRoutes(mode, dims, epochs, lengths, rows_fed=actor.rows_fed)   # before scoring
    routes.put_rollout(samples)                                       # R3: the engine's routes
    mb = routes.attach(mini_batch, part)                              # before each scoring / update pass
    routes.after_scoring(part, scored, lengths)                       # R2: keep the recorded routes
    routes.metrics()                                                  # cache size, agreement metrics

The actor says which rows of a mini-batch it feeds on this rank (`rows_fed`, from the rows' sequence lengths);
other rows get placeholder experts that are never fed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from megatron_rl.routing.agreement import mean_route_metrics
from megatron_rl.routing.cache import RouteCache
from megatron_rl.routing.replay import ReplayMode


class RouteShape(Protocol):
    """What routes look like for a model (`megatron_backend.models.family.ModelDims` is one)."""

    @property
    def top_k(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def moe_layers(self) -> list[int]: ...


class StepRoutes:
    """This rank's routes of one step's batch for R2/R3 (see the module docstring)."""

    def __init__(
        self,
        mode: ReplayMode,
        dims: RouteShape,
        epochs: list[list[list[int]]],
        lengths: list[int],
        *,
        rows_fed: Callable[[list[int]], list[int]],
    ):
        """`epochs`: each epoch's mini-batches (rows of the step's batch); `lengths`: every row's sequence length."""
        if not mode.on:
            raise ValueError("StepRoutes needs routing replay R2 or R3")
        self.mode, self.dims, self.rows_fed = mode, dims, rows_fed
        self.mine = {part[j] for parts in epochs for part in parts for j in rows_fed([lengths[i] for i in part])}
        self.cache = RouteCache(len(dims.moe_layers), dims.top_k, dims.num_experts)
        self._agreements: list[dict[str, float]] = []

    @property
    def scoring_mode(self) -> Literal["record", "replay"]:
        """What the old-policy pass does with routes: R2 records them, R3 replays the engine's."""
        return "record" if self.mode.record_old_logprobs else "replay"

    def put_rollout(self, samples: list) -> None:
        """R3: the engine's routes (SGLang layout) of this rank's samples."""
        if not self.mode.routes_from_rollout:
            return
        for i in sorted(self.mine):
            if samples[i].routed_experts is None:
                raise ValueError(f"sample {i} has no routed_experts but routing replay R3 is on")
            self.cache.put(i, samples[i].routed_experts, num_tokens=len(samples[i].tokens))

    def attach(self, mini_batch: Any, part: list[int]) -> Any:
        """`mini_batch` (rows `part` of the step's batch) with `routes` set for the rows this rank feeds."""
        fed = set(self.rows_fed(mini_batch.lengths.tolist()))
        keys = [i if j in fed else None for j, i in enumerate(part)]
        mini_batch.routes = self.cache.batch_routes(keys, mini_batch.input_ids.shape[1])
        return mini_batch

    def after_scoring(self, part: list[int], scored: Any, lengths: torch.Tensor) -> None:
        """R2: keep the routes the old-policy pass recorded (`[rows, seq, layers, k]`), this rank's rows only.
        R3: keep the agreement of the engine's routes with the trainer's (`routing/rollout_*` metrics)."""
        if self.mode.replay_old_logprobs:
            if scored.agreement is not None:
                self._agreements.append(scored.agreement.as_metrics("routing/rollout_", self.dims.moe_layers))
            return
        # Keep every row the micro-batch fed (the last token's and its padding; unfed rows read as one
        # repeated expert), so the first update's replay re-runs the recording bitwise.
        recorded = scored.routes
        ordered = recorded.sort(-1).values
        fed = (ordered[..., 1:] != ordered[..., :-1]).all(-1).all(-1)  # [rows, seq]
        for j, i in enumerate(part):
            if i in self.mine:
                n = int(lengths[j])
                width = max(n, int(fed[j].nonzero().max()) + 1 if fed[j].any() else n)
                self.cache.put(i, recorded[j, :width], num_tokens=n, recorded=True)

    def metrics(self, updates: list[dict[str, float]]) -> dict[str, float]:
        """Cache footprint, and the agreement metrics of the scoring passes (R3) and of `updates` (the
        `routing/*` entries of each update's metrics), mean over passes."""
        tokens = sum(self.cache.get(k).shape[0] for k in self.mine if k in self.cache)
        return {
            "routing/cache_samples": float(len(self.cache)),
            "routing/cache_mib": self.cache.nbytes / 2**20,
            "routing/cache_bytes_per_token": self.cache.nbytes / max(tokens, 1),
            **mean_route_metrics(updates + self._agreements),
        }
