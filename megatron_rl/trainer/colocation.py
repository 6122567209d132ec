"""Who holds the accelerator when the trainer and the rollout engine share it (`trainer.colocate`).

Phases of a step and what is resident (with `rollout.release_memory` and `trainer.offload_actor` on):

    rollout   engine weights + caches;     actor on the host              `for_rollout()`
    train     actor;                       engine weights + caches freed  `for_training()`
    sync      actor + engine weights;      caches freed                   `for_weight_sync()`

(caches: SGLang's KV cache and CUDA-graph buffers, `rollout.engine_memory.CACHE_TAGS`).

The order follows SGLang's memory contract (`rollout.engine_memory`): released engine weights are discarded, so they
are resumed only right before the weight sync that fills them; the caches come back after the sync, when the actor
has left. Evaluation and checkpoints between steps use `for_rollout()` / `for_training(keep_engine_weights=True)`:
the engine's weights are current then, and releasing them would need another sync. Each call does only what the
current state needs, so the loop can call them unconditionally. The engine lives on rank 0 only (a
`rollout_phase.NoEngine`, whose memory calls do nothing, elsewhere); every rank offloads its own actor shard. A
server that fails a release or resume is reported and left to the loop's recovery (the next sync or generate fails
with a `RolloutEngineError`, the server is restarted and given the weights): raising here would leave the other
ranks waiting in the weight export.
"""

from __future__ import annotations

import time

from megatron_rl.megatron_backend import platform
from megatron_rl.rollout.engine import RolloutEngineError
from megatron_rl.rollout.engines.engine_memory import CACHE_TAGS, MEMORY_TAGS

__all__ = ["ColocatedMemory"]


class ColocatedMemory:
    """Moves the actor (and the critic, which follows it) and the engine's memory between phases; collects
    `memory/*` and `time/*` metrics."""

    def __init__(self, actor, engine, *, offload_actor: bool, release_engine: bool, critic=None):
        self.models = {"actor": actor} if critic is None else {"actor": actor, "critic": critic}
        self.engine = engine
        self.offload_actor = offload_actor
        self.release_engine = release_engine
        self._metrics: dict[str, float] = {}

    def for_rollout(self) -> None:
        """Actor to the host, the engine's caches back (its weights are resident: the last sync filled them)."""
        for name, model in self.models.items():
            if self.offload_actor and not model.offloaded:
                stats = model.offload()
                self._add(f"time/{name}_offload", stats.seconds)
                self._metrics[f"memory/{name}_offloaded_gib"] = stats.gib
                self._sample_device("memory/device_gib_rollout")
        if self.release_engine:
            t = time.perf_counter()
            self._engine_call(self.engine.resume_memory, list(CACHE_TAGS))
            self._add("time/engine_resume", time.perf_counter() - t)

    def for_training(self, *, keep_engine_weights: bool = False) -> None:
        """The engine frees its caches (and its weights unless kept), the actor comes back."""
        if self.release_engine:
            t = time.perf_counter()
            tags = CACHE_TAGS if keep_engine_weights else MEMORY_TAGS
            self._engine_call(self.engine.release_memory, list(tags))
            self._add("time/engine_release", time.perf_counter() - t)
        for name, model in self.models.items():
            if model.offloaded:
                stats = model.reload()
                self._add(f"time/{name}_reload", stats.seconds)
                self._sample_device("memory/device_gib_train")

    def for_weight_sync(self) -> None:
        """The engine re-allocates released weights, to be filled by the sync that follows."""
        if self.release_engine:
            t = time.perf_counter()
            self._engine_call(self.engine.resume_memory, ["weights"])
            self._add("time/engine_resume", time.perf_counter() - t)

    def pop_metrics(self) -> dict[str, float]:
        """Metrics since the last call."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    @staticmethod
    def _engine_call(method, tags: list[str]) -> None:
        try:
            method(tags)
        except RolloutEngineError as err:
            print(f"rollout engine: {method.__name__}({tags}) failed ({err}); the next rollout recovers", flush=True)

    def _add(self, key: str, seconds: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + seconds

    def _sample_device(self, key: str) -> None:
        """This rank's allocated accelerator memory now (GPU only: on CPU the engine and actor share RAM)."""
        allocated = platform.memory_allocated(platform.device())
        if allocated is not None:
            self._metrics[key] = allocated / 2**30
