"""The trainer's side of the rollout engine: one step's rollout (with server restarts) and the weight sync.

A step's batch comes from a `RolloutSource`: `SyncRollout` generates it when asked; `async_rollout.AsyncRollout`
takes it from the producer thread.

The engine lives on rank 0 (`engine=None` elsewhere); every rank takes part in the weight export, so each
function here is collective. Rank 0 keeps the step's samples: every rank learns their lengths and rewards (a few
bytes each), and each data-parallel rank is sent only the samples it trains on (`share_rows`).
"""

from __future__ import annotations

import dataclasses
import pickle
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.distributed import broadcast_object, scatter_by_data_parallel_rank
from megatron_rl.rollout.data import PromptData
from megatron_rl.rollout.engine import RolloutEngine, RolloutEngineError
from megatron_rl.rollout.engines.engine_factory import EngineRun
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.weight_version import weight_version
from megatron_rl.trainer.colocation import ColocatedMemory
from megatron_rl.trainer.step_metrics import rollout_metrics
from megatron_rl.trainer.step_plan import StepPlan

if TYPE_CHECKING:
    from megatron_rl.trainer.guards.sync_verification import SyncVerifier


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


@dataclass
class StepRollout:
    """One step's rollout as every rank sees it: each sample's token count and reward, the rollout metrics, and
    the samples themselves on rank 0 only (`share_rows` sends each data-parallel rank its own)."""

    lengths: list[int]
    rewards: list[float]
    metrics: dict[str, float]
    samples: list[Sample] | None = None


class NoRollout:
    """The `RolloutSource` of the ranks that hold no engine (all but rank 0): they produce nothing and their
    weight updates wait on nothing."""

    def produce(self, step: int) -> tuple[list, dict[str, float]]:
        raise RuntimeError("only rank 0 produces rollouts")

    def rewind(self) -> None:
        pass

    def updating(self, version: int, *, on_schedule: bool = True) -> AbstractContextManager:
        return nullcontext()


def prompt_data(cfg: Any, tokenizer: Any) -> PromptData:
    """The run's prompts (`rollout.data.PromptData`) from the sections of `cfg` (an `RLConfig`) they read."""
    return PromptData(cfg.data, cfg.rollout, cfg.algo, cfg.warmup, seed=cfg.trainer.seed, tokenizer=tokenizer)


def engine_run(cfg: Any) -> EngineRun:
    """What the rollout engine needs to know of the run `cfg` (an `RLConfig`) besides its `rollout` section."""
    return EngineRun(cfg.trainer.output_dir, cfg.trainer.mode == "async", cfg.algo.routing_replay == "R3")


def collect_rollout(
    cfg: Any,
    step: int,
    actor: MegatronActor,
    engine: RolloutEngine | None,
    source: RolloutSource,
    memory: ColocatedMemory,
    verifier: SyncVerifier | None = None,
) -> StepRollout:
    """Rank 0 takes the step's samples from `source` and tells every rank their lengths and rewards. When a
    rollout server (or the engine's process) dies or hangs, the engine restarts it, every rank re-sends the
    current weights and the step's rollout is retried from the same prompt position (at most
    `rollout.restarts_per_step` times)."""
    restarts = 0
    while True:
        outcome: Any = None
        samples: list[Sample] = []
        if engine is not None:
            try:
                samples, metrics = source.produce(step)
                unscored = [i for i, s in enumerate(samples) if s.reward is None]
                if unscored:
                    raise ValueError(f"step {step}: sample {unscored[0]} has no reward; score it first")
                lengths, rewards = [len(s.tokens) for s in samples], [float(s.reward or 0.0) for s in samples]
                outcome = StepRollout(lengths, rewards, {**metrics, "rollout/restarts": restarts})
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
        if isinstance(outcome, StepRollout):
            return dataclasses.replace(outcome, samples=samples if engine is not None else None)
        restarts += 1
        memory.for_training(keep_engine_weights=True)  # the actor exports: it must be resident
        with source.updating(step - 1, on_schedule=False):
            what = f"step {step}: re-sending the weights"
            sync_or_defer(actor, engine, cfg, version=weight_version(step - 1), what=what, verifier=verifier)
        memory.for_rollout()


def share_rows(samples: list[Sample] | None, plan: StepPlan) -> tuple[list[Sample], int]:
    """`(samples, bytes)`: the samples this data-parallel rank trains on (`plan.rows_of`, ascending), sent from rank
    0 (which holds them all, `samples`) to that rank's ranks only, and the pickled bytes this rank received (0 on
    rank 0). A sample travels with what training reads: tokens, engine log-probs, masks and its routes (compact,
    uint8/int16); its prompt text, answer and reward parts stay on rank 0, which logs them."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if samples is not None:
        parts = [[_for_training(samples[i]) for i in plan.rows_of(r)] for r in range(dp)]
        peers = dist.get_world_size() > dp  # model-parallel peers of data-parallel rank 0 receive its part too
        blobs = [pickle.dumps(part, pickle.HIGHEST_PROTOCOL) if r or peers else b"" for r, part in enumerate(parts)]
        scatter_by_data_parallel_rank(blobs)
        return parts[0], 0
    blob = scatter_by_data_parallel_rank(None)
    return pickle.loads(blob), len(blob)


def _for_training(sample: Sample) -> Sample:
    excluded = bool(sample.metadata.get("exclude_from_loss"))
    return dataclasses.replace(sample, metadata={"exclude_from_loss": True} if excluded else {}, reward_parts={})


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
