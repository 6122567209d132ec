"""The trainer's side of the rollout engine: one step's rollout (with server restarts) and the weight sync.

A step's batch comes from a `RolloutSource`: `SyncRollout` generates it when asked; `async_rollout.AsyncRollout`
takes it from the producer thread. Rank 0 holds the engine; the other ranks hold a `NoEngine` and a `NoRollout`,
which take part in what is collective (the weight export) and do nothing else. Rank 0 keeps the step's samples:
every rank learns their lengths and rewards (a few bytes each), and each data-parallel rank is sent only the
samples it trains on (`step_plan.share_rows`). `WeightSync` is the one place a weight version is named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch.distributed as dist

from megatron_rl.config.options import sglang_lora_modules
from megatron_rl.config.side_models import launched, with_side_urls
from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.distributed import broadcast_object
from megatron_rl.megatron_backend.lora.sync_payload import adapted_weights, adapter_payload, base_weights
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.rollout.data import PromptData
from megatron_rl.rollout.engine import AdapterEngine, NamedTensorBucket, RolloutEngine, RolloutEngineError
from megatron_rl.rollout.engines.engine_factory import EngineRun, build_engine
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.weight_version import weight_version
from megatron_rl.trainer.colocation import ColocatedMemory
from megatron_rl.trainer.step.step_metrics import rollout_metrics

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
    the samples themselves on rank 0 only (`step_plan.share_rows` sends each data-parallel rank its own)."""

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


class NoEngine:
    """The `RolloutEngine` of the ranks that hold none (all but rank 0): it drains this rank's share of each weight
    export (the export's gathers are collective) and holds no memory to release; only rank 0 generates."""

    @property
    def weight_version(self) -> str:
        raise RuntimeError("only rank 0 holds the rollout engine")

    def generate(self, prompts: list[list[int]], params: Any, *, n: int = 1, return_routed_experts: bool = False):
        raise RuntimeError("only rank 0 holds the rollout engine")

    def update_weights(self, buckets: Iterable[Any], version: str) -> None:
        for _ in buckets:
            pass

    def load_adapter(self, tensors: dict, config: dict, version: str) -> None:
        pass

    def score_prompts(self, prompts: list[list[int]], top_k: int = 0):
        raise RuntimeError("only rank 0 holds the rollout engine")

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def healthy(self) -> bool:
        return True

    def release_memory(self, tags: list[str] | None = None) -> None:
        pass

    def resume_memory(self, tags: list[str] | None = None) -> None:
        pass

    def recover(self) -> list[str]:
        return []

    def shutdown(self) -> None:
        pass


@dataclass
class WeightSync:
    """The actor's weights to the rollout engine (`NoEngine` on ranks other than 0), collective: every rank exports.
    `send(step)` stamps them with `weight_version(step)` (the policy after RL step `step`), the one place a weight
    version is named. With a `verifier`, the syncs `rollout.verify_sync` asks for are checked against the engine's
    probe scores.

    Under LoRA the frozen base stays in the engine between syncs, so after the first sync of a start only what the
    adapters change goes (`lora.sync_payload`): the merged weights of the adapted layers, or with
    `rollout.lora_sync=adapter` the adapters alone (the base went once, adapters off). Everything goes at the first
    sync, after a failed one, when asked (`full`: a restarted server), and at every sync with
    `rollout.release_memory` (the engine discards its weights while the trainer trains) or, merged,
    `rollout.weight_sync=disk` (the servers read a whole checkpoint directory)."""

    actor: MegatronActor
    engine: RolloutEngine
    rollout: Any  # the run's `rollout` section (`bucket_mb`, `release_memory`, `weight_sync`, `lora_sync`)
    verifier: SyncVerifier | None = None
    _full_next: bool = field(default=True, init=False)  # rank 0's say: the engine may not hold the base
    _metrics: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.adapter_only and not isinstance(self.engine, AdapterEngine):
            raise ValueError(
                f"rollout.lora_sync=adapter: the {type(self.engine).__name__} serves no LoRA adapters; use "
                "rollout.lora_sync=merged or rollout.engine=sglang"
            )

    @property
    def adapter_only(self) -> bool:
        return self.actor.lora is not None and self.rollout.lora_sync == "adapter"

    def send(self, step: int, *, full: bool = False) -> None:
        """The policy after step `step` to the engine (`full`: every tensor); a `RolloutEngineError` on rank 0 when
        the engine failed."""
        version = weight_version(step)
        full = self._needs_full(full)
        bucket_bytes = self.rollout.bucket_mb << 20
        if self.adapter_only:
            failed = self._update(base_weights(self.actor, bucket_bytes), version) if full else None
            failed = self._load_adapter(version, failed)
        else:
            only = None if full else self._adapted()
            failed = self._update(self.actor.export_hf(bucket_bytes=bucket_bytes, only=only), version)
        self._full_next = failed is not None
        self._metrics["sync/full_syncs"] = self._metrics.get("sync/full_syncs", 0.0) + full
        if self.verifier is not None:
            self.verifier.after_sync(self.actor, self.engine, version, synced=failed is None, partial=not full)
        if failed is not None:
            raise failed

    def send_or_defer(self, step: int, what: str, *, full: bool = False) -> None:
        """`send`, or, when the engine fails (rank 0 only), say so and leave the repair to the next rollout (it
        restarts the server and re-sends the weights)."""
        try:
            self.send(step, full=full)
        except RolloutEngineError as err:
            print(f"{what} failed ({err}); recovering at the next rollout", flush=True)

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: `sync/bytes` and `sync/tensors` sent (HF tensors in their dtype; the adapters in
        fp32), `sync/full_syncs` (syncs that sent every tensor) and the verified syncs' (`SyncVerifier.pop_metrics`)."""
        metrics, self._metrics = self._metrics, {}
        return {**metrics, **(self.verifier.pop_metrics() if self.verifier is not None else {})}

    def _needs_full(self, asked: bool) -> bool:
        """Collective: whether this sync sends every tensor (rank 0 knows whether its engine took the last one)."""
        keeps = self.actor.lora is not None and not self.rollout.release_memory
        if not keeps or (self.rollout.weight_sync == "disk" and not self.adapter_only):
            return True
        return broadcast_object(self._full_next) or asked

    def _adapted(self) -> frozenset[str] | None:
        """What a partial merged sync exports: the weights the adapters add to (None: all, without LoRA)."""
        actor = self.actor
        return None if actor.lora is None else adapted_weights(actor.family.weight_map(actor.hf_config), actor.lora)

    def _update(self, buckets: Iterator[NamedTensorBucket], version: str) -> RolloutEngineError | None:
        try:
            self.engine.update_weights(self._counted(buckets), version)
        except RolloutEngineError as err:
            for _ in buckets:  # the other ranks are still exporting: finish the collective before raising
                pass
            return err
        return None

    def _load_adapter(self, version: str, failed: RolloutEngineError | None) -> RolloutEngineError | None:
        payload = adapter_payload(self.actor, "")  # collective; rank 0 holds it
        if payload is None or failed is not None:
            return failed
        tensors, config = payload
        try:
            cast(AdapterEngine, self.engine).load_adapter(tensors, config, version)
        except RolloutEngineError as err:
            return err
        self._count(list(tensors.items()))
        return None

    def _counted(self, buckets: Iterator[NamedTensorBucket]) -> Iterator[NamedTensorBucket]:
        for bucket in buckets:
            yield bucket
            self._count(bucket)  # taken by the engine

    def _count(self, tensors: NamedTensorBucket) -> None:
        sent = sum(t.numel() * t.element_size() for _, t in tensors)
        self._metrics["sync/bytes"] = self._metrics.get("sync/bytes", 0.0) + sent
        self._metrics["sync/tensors"] = self._metrics.get("sync/tensors", 0.0) + len(tensors)


def prompt_data(cfg: Any, tokenizer: Any, teacher: RolloutEngine | None = None) -> PromptData:
    """The run's prompts (`rollout.data.PromptData`) from the sections of `cfg` (an `RLConfig`) they read; with an
    engine-served distillation `teacher`, it scores each training batch."""
    return PromptData(
        cfg.data, cfg.rollout, cfg.algo, cfg.warmup, seed=cfg.trainer.seed, tokenizer=tokenizer, teacher=teacher
    )


def teacher_engine(cfg: Any, closing: ExitStack) -> RolloutEngine | None:
    """Rank 0: the distillation teacher served by an engine (`algo.distill.served_by`: a local engine, or SGLang
    servers it connects to or launches), never sent weights; it scores each training batch as it is collected
    (`rollout/teacher_scores.py`). None for a Megatron teacher or without distillation."""
    distill = cfg.algo.distill
    if not distill.teacher or distill.served_by == "megatron":
        return None
    rollout = dataclasses.replace(cfg.rollout, engine="local", release_memory=False)  # it keeps its weights
    if distill.served_by == "sglang":
        sglang = dataclasses.replace(
            cfg.rollout.sglang, urls=distill.sglang_urls, router_url="", num_servers=1, base_port=distill.sglang_port,
            router=False,
        )  # fmt: skip
        rollout = dataclasses.replace(rollout, engine="sglang", sglang=sglang, weight_sync="tensor")
    run = EngineRun(str(Path(cfg.trainer.output_dir) / "teacher"))
    engine = build_engine(rollout, run, Path(distill.teacher), platform.device())
    closing.callback(engine.shutdown)
    return engine


def serve_side_models(cfg: Any, closing: ExitStack) -> Any:
    """`cfg` (an `RLConfig`) with its `side:` references resolved, on every rank. Rank 0 first launches each side
    model without urls (`rollout.side_models`; stopped when `closing` closes) with rollout.sglang's key file, which
    the returned config names so that rollout servers launched later share the key."""
    todo = launched(cfg.rollout.side_models)
    if not todo:
        return with_side_urls(cfg, cfg.rollout.sglang.api_key_file)
    from megatron_rl.rollout.sglang.api_key import launch_api_key_file
    from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers

    sg, out = cfg.rollout.sglang, Path(cfg.trainer.output_dir)
    if sg.api_key_env:
        raise ValueError(
            "rollout.side_models without urls are launched with rollout.sglang.api_key_file's key, but "
            f"rollout.sglang.api_key_env={sg.api_key_env} names another: give the side models' urls"
        )
    key_file = str(launch_api_key_file(sg.api_key_file, out)) if dist.get_rank() == 0 else None
    urls: dict[int, tuple[str, ...]] = {}
    if dist.get_rank() == 0:
        for i in todo:
            side = cfg.rollout.side_models[i]
            servers = SGLangServers.launch(
                SGLangLaunchConfig(
                    model_path=side.hf_path, python=sg.python, num_servers=side.num_servers,
                    extra_args=("--tp-size", str(side.tp), "--mem-fraction-static", str(side.mem_fraction_static),
                                *sg.extra_args),
                    log_dir=str(out / "side_models" / side.name), startup_timeout_s=sg.startup_timeout_s,
                    api_key_file=str(key_file),
                )
            )  # fmt: skip
            closing.callback(servers.stop)
            urls[i] = tuple(servers.urls)
    urls, key_file = broadcast_object((urls, key_file))
    models = tuple(dataclasses.replace(m, urls=urls.get(i, m.urls)) for i, m in enumerate(cfg.rollout.side_models))
    sglang = dataclasses.replace(sg, api_key_file=key_file)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, side_models=models, sglang=sglang))
    return with_side_urls(cfg, key_file)


def engine_run(cfg: Any) -> EngineRun:
    """What the rollout engine needs to know of the run `cfg` (an `RLConfig`) besides its `rollout` section."""
    lora = cfg.model.lora
    served = cfg.rollout.lora_sync == "adapter" and lora.rank > 0  # SGLang serves the adapters
    modules = sglang_lora_modules(read_hf_config(cfg.model.hf_path), lora.targets) if served else ()
    return EngineRun(cfg.trainer.output_dir, cfg.trainer.mode == "async", cfg.algo.routing_replay == "R3",
                     lora.rank if served else 0, modules)  # fmt: skip


def collect_rollout(
    restarts_per_step: int, step: int, weights: WeightSync, source: RolloutSource, memory: ColocatedMemory
) -> StepRollout:
    """Rank 0 takes the step's samples from `source` and tells every rank their lengths and rewards. When a
    rollout server (or the engine's process) dies or hangs, the engine restarts it, every rank re-sends the
    current weights and the step's rollout is retried from the same prompt position (at most `restarts_per_step`
    times)."""
    rank0 = dist.get_rank() == 0
    restarts = 0
    while True:
        outcome: Any = None
        samples: list[Sample] = []
        if rank0:
            try:
                samples, metrics = source.produce(step)
                unscored = [i for i, s in enumerate(samples) if s.reward is None]
                if unscored:
                    raise ValueError(f"step {step}: sample {unscored[0]} has no reward; score it first")
                lengths, rewards = [len(s.tokens) for s in samples], [float(s.reward or 0.0) for s in samples]
                outcome = StepRollout(lengths, rewards, {**metrics, "rollout/restarts": restarts})
            except RolloutEngineError as err:
                outcome = err
                if restarts < restarts_per_step:
                    try:
                        restarted = weights.engine.recover()
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
                f"{restarts_per_step}): {outcome}"
            ) from (outcome if rank0 else None)
        if isinstance(outcome, StepRollout):
            return dataclasses.replace(outcome, samples=samples if rank0 else None)
        restarts += 1
        memory.for_training(keep_engine_weights=True)  # the actor exports: it must be resident
        with source.updating(step - 1, on_schedule=False):
            weights.send_or_defer(step - 1, f"step {step}: re-sending the weights", full=True)
        memory.for_rollout()
