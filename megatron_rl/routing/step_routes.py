"""Routing replay over one RL step: the routes of the samples this data-parallel rank feeds.

R2 records the routes in the old-policy pass and replays them in every update; R3 replays the rollout
engine's routes in the old-policy pass and in every update (`routing.replay`). `StepRoutes` keeps them in a
compact host `RouteCache`, keyed by the sample's row in the step's batch, and is used by the step in four places:

    routes = StepRoutes(mode, dims, rows)                             # rows: the samples this rank feeds
    routes.put_rollout(samples)                                       # R3: the engine's routes of those rows
    mb = routes.attach(mini_batch, keys)                              # before each scoring / update pass
    routes.after_scoring(keys, scored, lengths)                       # R2: keep the recorded routes
    routes.metrics()                                                  # cache size, agreement metrics

A rank is only ever given its own rows (`trainer.step.step_plan`), so every row of a mini-batch it passes is fed.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

from megatron_rl.routing.agreement import mean_route_metrics
from megatron_rl.routing.cache import RouteCache
from megatron_rl.routing.replay import ReplayMode


class RouteShape(Protocol):
    """What routes look like for a model (`megatron_rl.models.family.ModelDims` is one)."""

    @property
    def top_k(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def moe_layers(self) -> list[int]: ...


class StepRoutes:
    """This rank's routes of one step's batch for R2/R3 (see the module docstring)."""

    def __init__(self, mode: ReplayMode, dims: RouteShape, rows: list[int]):
        """`rows`: the rows of the step's batch this rank feeds (in any pass of the step)."""
        if not mode.on:
            raise ValueError("StepRoutes needs routing replay R2 or R3")
        self.mode, self.dims = mode, dims
        self.mine = set(rows)
        self.cache = RouteCache(len(dims.moe_layers), dims.top_k, dims.num_experts)
        self._agreements: list[dict[str, float]] = []

    @property
    def scoring_mode(self) -> Literal["record", "replay"]:
        """What the old-policy pass does with routes: R2 records them, R3 replays the engine's."""
        return "record" if self.mode.record_old_logprobs else "replay"

    def put_rollout(self, samples: dict[int, Any]) -> None:
        """R3: the engine's routes (SGLang layout) of this rank's samples, by row."""
        if not self.mode.routes_from_rollout:
            return
        for i in sorted(self.mine):
            if samples[i].routed_experts is None:
                raise ValueError(f"sample {i} has no routed_experts but routing replay R3 is on")
            self.cache.put(i, samples[i].routed_experts, num_tokens=len(samples[i].tokens))

    def attach(self, mini_batch: Any, keys: list[int]) -> Any:
        """`mini_batch` (rows `keys` of the step's batch, all fed by this rank) with `routes` set."""
        mini_batch.routes = self.cache.batch_routes(list(keys), mini_batch.input_ids.shape[1])
        return mini_batch

    def after_scoring(self, keys: list[int], scored: Any, lengths: torch.Tensor) -> None:
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
        for j, i in enumerate(keys):
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
