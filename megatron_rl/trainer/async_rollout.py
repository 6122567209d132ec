"""Asynchronous RL (`trainer.mode: async`): a rollout producer generates ahead of the trainer, at bounded staleness.

The producer is a thread of rank 0 that owns the rollout engine's requests; the trainer takes finished batches and
sends new weights between requests. With `k = trainer.max_staleness`:

* the batch of step `t` is generated on weights of version `t-1-k` (version v = the weights after step v; the
  run's first batches use version 0), so the trainer, at version `t-1` when it trains step `t`, trains on samples
  exactly k versions old (slime's `train_async.py`, verl's one-step off-policy for k = 1; NeMo-RL's and AReaL's
  maximum trajectory age). The producer starts batch `t` once the engine holds version `t-1-k`, and the weight
  update to version `v` waits until batch `v+k` is generated: the schedule is a function of the step alone, so an
  async run is reproducible, k = 0 is the sync loop exactly, and a resume is exact (below).
* `rollout.partial`: the update does not wait; it interrupts the requests in flight, which continue under the new
  weights (`partial_rollout`): each token keeps its own version and log-prob; a batch's oldest tokens are still at
  most k versions old. Interruption times depend on timing: partial runs are not bitwise reproducible.
* Checkpoints keep the generated, untrained batches (JSON, exact) and the prompt position after the last of them;
  the batch being generated is dropped and generated again after a resume, on the same version as before.
* A failed rollout (dead server, dead engine process) comes to the trainer as the step's batch; the trainer
  restarts the engine, every rank re-sends the current weights, and the producer generates the batch again.

Off-policy correction: the first update's ratio is against θ_old (the trainer's scoring), and the behaviour
policy's log-probs enter through `algo.rollout_correction` (decoupled PPO: Hilton et al. 2021, arXiv 2110.00641;
AReaL, arXiv 2505.24298), on by default in async mode (docs/algorithms.md, item 17).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engine import RolloutEngine, RolloutEngineError
from megatron_rl.rollout.partial_rollout import generate_continuing, version_spans
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.weight_version import version_step
from megatron_rl.trainer.step.step_metrics import rollout_metrics


def oldest_version(sample: Sample) -> int:
    """The oldest weight version behind any of the sample's tokens."""
    return min(version_step(v) for v, _, _ in version_spans(sample))


@dataclass
class ProducedBatch:
    """One step's rollout as the producer made it: the samples (empty when none was kept), the rollout metrics,
    and the prompt position after it (what a checkpoint taken before training it must resume from)."""

    step: int
    samples: list[Sample]
    metrics: dict[str, float]
    data_state: dict
    error: RolloutEngineError | None = None
    generate_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            raise ValueError("a failed batch is not kept in a checkpoint")
        return {
            "step": self.step,
            "samples": [s.to_json() for s in self.samples],
            "metrics": self.metrics,
            "data_state": self.data_state,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProducedBatch:
        samples = [Sample.from_json(s) for s in data["samples"]]
        return cls(data["step"], samples, data["metrics"], data["data_state"])


class EngineGate:
    """Serialises the producer's engine requests with the trainer's weight updates and evaluations: one holds the
    engine at a time, and a waiting update goes before new requests."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._cond = threading.Condition()
        self._busy = False
        self._updates_waiting = 0
        self.interruptions = 0  # updates that aborted requests in flight (partial rollouts)

    @contextmanager
    def request(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy and not self._updates_waiting)
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def exclusive(self, *, interrupt: bool) -> Iterator[None]:
        """Hold the engine (after the request in flight; `interrupt`: abort that request first)."""
        with self._cond:
            self._updates_waiting += 1
            if interrupt and self._busy:
                self.interruptions += 1
                self.engine.abort()
            self._cond.wait_for(lambda: not self._busy)
            self._busy = True
            self._updates_waiting -= 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


class GatedEngine:
    """The engine as the producer and the trainer's evaluation see it: each `generate` is one request through the
    gate; with `partial`, requests an update aborted are continued (`partial_rollout.generate_continuing`). Every
    other method is the engine's own (the trainer calls them while it holds the gate)."""

    def __init__(self, gate: EngineGate, partial: bool):
        self._gate, self._partial = gate, partial

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gate.engine, name)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, return_routed_experts: bool = False
    ) -> list[Sample]:
        if self._partial:
            return generate_continuing(
                _OneRequest(self._gate), prompts, params, n, return_routed_experts, lambda: self._gate.interruptions
            )
        return _OneRequest(self._gate).generate(prompts, params, n=n, return_routed_experts=return_routed_experts)


class _OneRequest:
    def __init__(self, gate: EngineGate):
        self._gate = gate

    def generate(self, prompts, params, *, n=1, return_routed_experts=False) -> list[Sample]:
        with self._gate.request():
            return self._gate.engine.generate(prompts, params, n=n, return_routed_experts=return_routed_experts)


class RolloutProducer:
    """Rank 0's producer thread: generates the batches of steps `next_step..last_step` in order (see the module
    docstring for the schedule). `version` is the weight version the engine holds now; `queued` are batches a
    checkpoint kept."""

    def __init__(
        self,
        cfg: Any,
        engine: RolloutEngine,
        data: Any,
        *,
        next_step: int,
        last_step: int,
        version: int,
        queued: list[ProducedBatch] = (),  # type: ignore[assignment]
    ):
        self.k, self.partial = cfg.trainer.max_staleness, cfg.rollout.partial
        self.gate = EngineGate(engine)
        self.engine = GatedEngine(self.gate, self.partial)
        self.data, self.last_step = data, last_step
        self._queue: dict[int, ProducedBatch] = {b.step: b for b in queued}
        self._next = next_step + len(self._queue)
        self._version = version
        self._trained_data: dict | None = None  # prompt position after the batch the trainer took last
        self._cond = threading.Condition()
        self._retry = False
        self._stopping = False
        self._crash: BaseException | None = None  # what ended the producer thread unexpectedly
        self._engine_idle = 0.0  # seconds the producer waited for weights since the trainer last took a batch
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's side
    def take(self, step: int) -> tuple[ProducedBatch, dict[str, float]]:
        """Step `step`'s batch (waits for it) and the waiting metrics. A failed batch is returned as is: call
        `retry()` after repairing the engine."""
        t = time.perf_counter()
        with self._cond:
            ready = len(self._queue)
            self._cond.wait_for(lambda: step in self._queue or self._stopping or self._crash is not None)
            if self._crash is not None:
                raise RuntimeError(f"step {step}: the rollout producer failed: {self._crash!r}") from self._crash
            if self._stopping:
                raise RuntimeError("the rollout producer stopped")
            batch = self._queue.pop(step)
            if batch.error is None:
                self._trained_data = batch.data_state
            engine_idle, self._engine_idle = self._engine_idle, 0.0
        return batch, {
            "async/trainer_wait_s": time.perf_counter() - t,
            "async/engine_wait_s": engine_idle,
            "async/batches_ready": float(ready),
            "async/generate_s": batch.generate_s,
        }

    def retry(self) -> None:
        """Generate the failed batch again (the engine was restarted and has the current weights)."""
        with self._cond:
            self._retry = True
            self._cond.notify_all()

    @contextmanager
    def updating(self, version: int, *, on_schedule: bool = True) -> Iterator[None]:
        """Hold the engine for the weight update to `version`: after batch `version + k` was generated (or, with
        partial rollouts, interrupting the requests in flight). `on_schedule=False`: at once (re-sending the
        weights to a restarted engine while the producer waits to retry)."""
        if on_schedule and not self.partial:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._next > min(version + self.k, self.last_step)
                        or self._failed()
                        or self._stopping
                        or self._crash is not None
                    )
                )
        with self.gate.exclusive(interrupt=self.partial):
            yield
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def checkpoint_state(self) -> dict[str, Any]:
        """The batches generated and not yet trained, and the prompt position after the last of them."""
        with self._cond:
            kept = [self._queue[s] for s in sorted(self._queue) if self._queue[s].error is None]
            data = kept[-1].data_state if kept else self._trained_data
            return {"queued": [b.to_json() for b in kept], "data": data}

    def shutdown(self) -> None:
        """Stop generating (the request in flight is aborted) and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        try:
            self.gate.engine.abort()  # a request in flight ends at its next decode step
        except RolloutEngineError:  # a dead engine has nothing in flight
            pass
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the producer thread
    def _run(self) -> None:
        try:
            self._produce_all()
        except BaseException as err:  # a bug or a broken reward/environment: the trainer raises it at its next take
            with self._cond:
                self._crash = err
                self._cond.notify_all()

    def _produce_all(self) -> None:
        while True:
            with self._cond:
                t = time.perf_counter()
                self._cond.wait_for(lambda: self._stopping or self._next > self.last_step or self._can_start())
                self._engine_idle += time.perf_counter() - t
                if self._stopping or self._next > self.last_step:
                    return
                step = self._next
            batch = self._produce(step)
            with self._cond:
                self._queue[step] = batch
                if batch.error is None:
                    self._next += 1
                else:  # wait for the trainer to repair the engine; a trainer waiting to update sees the failure now
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._retry or self._stopping)
                    self._retry = False
                    self._queue.pop(step, None)
                self._cond.notify_all()

    def _can_start(self) -> bool:
        return self._version >= self._next - 1 - self.k and not self._failed()

    def _failed(self) -> bool:
        return any(b.error is not None for b in self._queue.values())

    def _produce(self, step: int) -> ProducedBatch:
        position = self.data.state_dict()
        t = time.perf_counter()
        try:
            rollout = self.data.collect(self.engine, step)
        except RolloutEngineError as err:
            self.data.load_state_dict(position)
            return ProducedBatch(step, [], {}, position, error=err)
        metrics = rollout_metrics(rollout)
        return ProducedBatch(step, rollout.samples, metrics, self.data.state_dict(), generate_s=time.perf_counter() - t)


def staleness_metrics(samples: list[Sample], step: int, k: int) -> dict[str, float]:
    """Versions behind the trainer (at version `step - 1` when it trains `step`) of each sample's oldest token: the
    histogram over 0..k, the mean and max, and the share of samples continued after an update (partial rollouts).
    A sample staler than k is a scheduling bug: it raises rather than trains."""
    behind = [step - 1 - oldest_version(s) for s in samples]
    if any(b > k for b in behind):
        raise RuntimeError(f"step {step}: samples {max(behind)} versions old exceed trainer.max_staleness={k}")
    counts = Counter(behind)
    n = max(len(samples), 1)
    return {
        "async/staleness_mean": sum(behind) / n,
        "async/staleness_max": float(max(behind, default=0)),
        **{f"async/staleness_frac_{v}": counts.get(v, 0) / n for v in range(k + 1)},
        "async/partial_share": sum(bool(s.metadata.get("continuations")) for s in samples) / n,
    }


class AsyncRollout:
    """The `rollout_phase.RolloutSource` of async mode: batches from the producer, checked for staleness."""

    def __init__(self, producer: RolloutProducer):
        self.producer = producer
        self._retry = False

    def produce(self, step: int) -> tuple[list, dict[str, float]]:
        if self._retry:
            self._retry = False
            self.producer.retry()
        batch, waits = self.producer.take(step)
        if batch.error is not None:
            raise batch.error
        metrics = {**batch.metrics, **waits, **staleness_metrics(batch.samples, step, self.producer.k)}
        return batch.samples, metrics

    def rewind(self) -> None:
        self._retry = True

    def updating(self, version: int, *, on_schedule: bool = True):
        return self.producer.updating(version, on_schedule=on_schedule)
