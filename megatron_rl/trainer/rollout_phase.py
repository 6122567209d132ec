"""The trainer's side of the rollout engine: one step's rollout (with server restarts) and the weight sync.

A step's batch comes from a `RolloutSource`: `SyncRollout` generates it when asked; `async_rollout.AsyncRollout`
takes it from the producer thread.

The engine lives on rank 0 (`engine=None` elsewhere); every rank takes part in the weight export, so each
function here is collective.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

from megatron_rl.megatron_backend.actor import MegatronActor
from megatron_rl.megatron_backend.distributed import broadcast_object
from megatron_rl.rollout.engine import RolloutEngine, RolloutEngineError
from megatron_rl.rollout.weight_version import weight_version
from megatron_rl.trainer.colocation import ColocatedMemory
from megatron_rl.trainer.step_metrics import rollout_metrics

if TYPE_CHECKING:
    from megatron_rl.trainer.sync_verification import SyncVerifier


class RolloutSource(Protocol):
    """Where rank 0's step batches come from: generated now (`SyncRollout`) or by the producer thread
    (`AsyncRollout`)."""

    def produce(self, step: int) -> tuple[list, dict[str, float]]:
        """Step `step`'s samples and rollout metrics; a `RolloutEngineError` when the engine failed."""
        ...

    def rewind(self) -> None:
        """After a failure: the next `produce` generates the step's batch again from the same prompts."""
        ...

    def updating(self, version: int, *, on_schedule: bool = True) -> AbstractContextManager:
        """Held while the weights of `version` are sent to the engine."""
        ...


class SyncRollout:
    """Each step generates its batch when the trainer asks (`trainer.mode: sync`)."""

    def __init__(self, engine: RolloutEngine, data: Any):
        self.engine, self.data = engine, data
        self._position: dict | None = None

    def produce(self, step: int) -> tuple[list, dict[str, float]]:
        self._position = self.data.state_dict()
        rollout = self.data.collect(self.engine, step)
        return rollout.samples, rollout_metrics(rollout)

    def rewind(self) -> None:
        self.data.load_state_dict(self._position)

    def updating(self, version: int, *, on_schedule: bool = True) -> AbstractContextManager:
        return nullcontext()


def collect_rollout(
    cfg: Any,
    step: int,
    actor: MegatronActor,
    engine: RolloutEngine | None,
    source: RolloutSource | None,
    memory: ColocatedMemory,
    verifier: SyncVerifier | None = None,
) -> tuple[list, dict[str, float]]:
    """Rank 0 takes the step's samples from `source` and shares them. When a rollout server (or the engine's
    process) dies or hangs, the engine restarts it, every rank re-sends the current weights and the step's rollout
    is retried from the same prompt position (at most `rollout.restarts_per_step` times)."""
    restarts = 0
    while True:
        outcome: Any = None
        if engine is not None and source is not None:
            try:
                samples, metrics = source.produce(step)
                outcome = (samples, {**metrics, "rollout/restarts": restarts})
            except RolloutEngineError as err:
                outcome = err
                if restarts < cfg.rollout.restarts_per_step:
                    try:
                        restarted = engine.recover()
                        print(f"step {step}: rollout failed ({err}); restarted {restarted or 'nothing'}, retrying",
                              flush=True)  # fmt: skip
                        source.rewind()
                        outcome = "retry"
                    except RolloutEngineError as failed:  # reported to every rank below, so none waits forever
                        outcome = failed
        outcome = broadcast_object(outcome)
        if isinstance(outcome, RolloutEngineError):
            raise RolloutEngineError(
                f"step {step}: rollout failed {restarts + 1} times (rollout.restarts_per_step="
                f"{cfg.rollout.restarts_per_step}): {outcome}"
            ) from (outcome if engine is not None else None)
        if outcome != "retry":
            return outcome
        restarts += 1
        memory.for_training(keep_engine_weights=True)  # the actor exports: it must be resident
        with source.updating(step - 1, on_schedule=False) if source is not None else nullcontext():
            what = f"step {step}: re-sending the weights"
            sync_or_defer(actor, engine, cfg, version=weight_version(step - 1), what=what, verifier=verifier)
        memory.for_rollout()


def sync_weights(
    actor: MegatronActor,
    engine: RolloutEngine | None,
    cfg: Any,
    *,
    version: str,
    verifier: SyncVerifier | None = None,
) -> None:
    """Stream the actor's weights (HF names) into the rollout engine (collective: every rank exports); with a
    `verifier`, the syncs it asks for are checked against the engine's probe scores."""
    buckets = actor.export_hf(bucket_bytes=cfg.rollout.bucket_mb << 20)
    failed: RolloutEngineError | None = None
    if engine is None:
        for _ in buckets:
            pass
    else:
        try:
            engine.update_weights(buckets, version)
        except RolloutEngineError as err:
            for _ in buckets:  # the other ranks are still exporting: finish the collective before raising
                pass
            failed = err
    if verifier is not None:
        verifier.after_sync(actor, engine, version, synced=engine is not None and failed is None)
    if failed is not None:
        raise failed


def sync_or_defer(
    actor: MegatronActor,
    engine: RolloutEngine | None,
    cfg: Any,
    *,
    version: str,
    what: str,
    verifier: SyncVerifier | None = None,
) -> None:
    """`sync_weights`, or, when the engine fails (rank 0 only), say so and leave the repair to the next rollout
    (it restarts the server and re-sends the weights)."""
    try:
        sync_weights(actor, engine, cfg, version=version, verifier=verifier)
    except RolloutEngineError as err:
        print(f"{what} failed ({err}); recovering at the next rollout", flush=True)
