"""The RL training loop, explicit: rollout -> rewards -> advantages -> old/ref log-probs -> updates -> sync.

Read top to bottom: `train(cfg)` plans the run folder, builds the parts of a step (`StepParts`), warms the policy
up with supervised steps when asked, then runs `trainer.steps` RL steps (`rl_step`), checkpointing and evaluating
between them. Rank 0 owns the rollout engine and sends each data-parallel rank only the samples it trains on
(`step_plan.rank_batch`); all ranks train. In async mode (`trainer.mode: async`) rank 0's batches
come from a producer thread that generates ahead of the trainer (`async_rollout`); the step is otherwise the same.
"""

from __future__ import annotations

import gc
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.algorithms.gae import ADVANTAGE as GAE
from megatron_rl.config import dump_yaml, format_config, to_dict
from megatron_rl.config.schema import RLConfig
from megatron_rl.config.stop_on import stop_rules
from megatron_rl.evaluation.runner import Evaluator
from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.actor.reference import reference_from_hf
from megatron_rl.megatron_backend.actor.teacher import FrozenScorer, teacher_from_hf
from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoint
from megatron_rl.megatron_backend.checkpoint.dist_checkpoint_files import check_checkpoint_files
from megatron_rl.megatron_backend.critic.value_model import MegatronCritic
from megatron_rl.megatron_backend.distributed import broadcast_object, decided_on_rank0, init_distributed, shutdown
from megatron_rl.megatron_backend.lora.peft_format import save_peft_adapter
from megatron_rl.megatron_backend.lora.reference import AdapterReference
from megatron_rl.megatron_backend.weights.hf_export import save_hf_checkpoint
from megatron_rl.models.architecture import max_positions, model_dims
from megatron_rl.models.family import ModelDims
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.rollout.engines.engine_factory import build_engine
from megatron_rl.trainer.async_rollout import AsyncRollout, ProducedBatch, RolloutProducer
from megatron_rl.trainer.colocation import ColocatedMemory
from megatron_rl.trainer.guards.fidelity_guard import FidelityGuard, FidelityStop
from megatron_rl.trainer.guards.input_guards import check_positions, check_teacher, check_tokenizer
from megatron_rl.trainer.guards.stop_signals import StopSignals
from megatron_rl.trainer.guards.sync_verification import build_verifier
from megatron_rl.trainer.logs import run_dir
from megatron_rl.trainer.logs.run_log import RunLog, run_header
from megatron_rl.trainer.logs.sample_log import SampleLog
from megatron_rl.trainer.rollout_phase import (
    NoEngine,
    NoRollout,
    SyncRollout,
    WeightSync,
    engine_run,
    prompt_data,
    serve_side_models,
    teacher_engine,
)
from megatron_rl.trainer.run_state import RunState
from megatron_rl.trainer.step.critic_phase import build_value_loss
from megatron_rl.trainer.step.rl_loss import build_rl_loss
from megatron_rl.trainer.step.rl_step import StepParts, rl_step
from megatron_rl.trainer.warmup import WarmupRun, check_warmup_data, run_warmup

WARMUP_MODEL = "warmup_model"  # the run folder's HF checkpoint of the warmed-up (SFT) model
WARMUP_ADAPTER = "adapter"  # in WARMUP_MODEL under LoRA: the warmed-up adapters (peft's format)


@dataclass
class TrainResult:
    output_dir: Path
    history: list[dict[str, float]]  # every step of the run, earlier starts' included
    plots: list[Path]
    stopped_by: int | None = None  # the signal (SIGINT/SIGTERM) that stopped the run at a step boundary
    already_complete: bool = False  # nothing was done: the run had reached trainer.steps


def train(cfg: RLConfig, *, resume_command: str | None = None, verbose: bool = False) -> TrainResult:
    """Run (or continue) the run in `trainer.output_dir`. `resume_command` is the command line shown when the
    run is interrupted (default: `megatron-rl train <output_dir>/config.yaml trainer.resume=auto`); `verbose`
    prints the whole resolved config at start-up instead of a short header."""
    output_dir = Path(cfg.trainer.output_dir)
    run_dir.check_output_dir(output_dir)  # before anything slow
    platform.bridge_cpu()  # (a no-op on CUDA) before Megatron's checkpoint writer is imported
    checkpoint.start_checkpoint_writer()  # before the handlers: a group signal must not kill the writer's helper
    with StopSignals(resume_command or run_dir.resume_command(cfg, None)) as stop:
        model_dir = prepare_model_dir(cfg)
        hf = read_hf_config(model_dir)
        dims = model_dims(hf)
        init_process_groups(cfg, dims)
        rank0 = stop.announce = dist.get_rank() == 0
        closing = ExitStack()  # the rollout engine and async mode's producer: shut down however the run ends
        try:
            # Rank 0 decides how this start uses output_dir, before the model is built; every rank gets the verdict.
            plan = decided_on_rank0(lambda: _plan(cfg))
            if plan.complete:
                if rank0:
                    print("\n".join([*plan.notes, plan.complete_message()]), flush=True)
                return TrainResult(output_dir, [], [], already_complete=True)
            if rank0:
                run_dir.start_run(plan)
            dist.barrier()
            stop.last_checkpoint = plan.start_step if plan.resume_from is not None else None
            return _run(cfg, plan, model_dir, dims, stop, closing, verbose)
        finally:
            gc.unfreeze()
            closing.close()  # the producer first, then the engine
            shutdown()


def init_process_groups(cfg: RLConfig, dims: ModelDims) -> None:
    """torch.distributed and Megatron's parallel state for `cfg.parallel` on the model `dims` describes."""
    init_distributed(cfg.parallel, seed=cfg.trainer.seed, dims=dims)


def _plan(cfg: RLConfig) -> run_dir.RunPlan:
    plan = run_dir.plan_run(cfg)
    if plan.resume_from is not None and not plan.complete:  # a damaged checkpoint is named before the build
        check_checkpoint_files(plan.resume_from)
    return plan


def _run(
    cfg: RLConfig,
    plan: run_dir.RunPlan,
    model_dir: Path,
    dims: ModelDims,
    stop: StopSignals,
    closing: ExitStack,
    verbose: bool,
) -> TrainResult:
    rank0 = dist.get_rank() == 0
    parts, state, log = _build_parts(cfg, plan, model_dir, dims, closing)
    # The model, optimizer, engine and libraries live for the whole run: keep them out of the garbage collector's
    # full collections, which otherwise walk them all (0.1-2 s each, about 8 per 14 demo steps).
    gc.freeze()
    if log is not None:
        dump_yaml(cfg, plan.output_dir / "config.yaml")
        print(format_config(cfg) if verbose else run_header(cfg, dims, plan.resume_from, state.step), flush=True)
    warmup = WarmupRun(plan.output_dir, plan.checkpoint_root, plan.identity.run_id, stop)
    if not _prepare_policy(parts, state, model_dir, plan.output_dir / WARMUP_MODEL, warmup):  # a signal mid-SFT
        plots = log.close() if log is not None else []
        return TrainResult(plan.output_dir, [], plots, stopped_by=warmup.stopped_by)
    parts = replace(
        parts,
        reference=_reference(cfg, parts.actor, model_dir, plan.output_dir / WARMUP_MODEL),
        teacher=_teacher_weights(cfg, parts.actor),
    )
    _first_sync(parts, state)
    if parts.critic is not None and state.step == 0:
        warm_up_critic(parts)
    evaluating = bool(cfg.data.eval and cfg.data.eval_every)
    if state.step == 0 and evaluating:
        parts.memory.for_rollout()
        if log is not None:
            log.log(0, parts.evaluate(0))  # the curve's start
    if rank0 and cfg.trainer.mode == "async":
        producer = RolloutProducer(
            cfg,
            parts.weights.engine,
            parts.data,
            next_step=state.step + 1,
            last_step=cfg.trainer.steps,
            version=state.step,
            queued=[ProducedBatch.from_json(b) for b in state.queued],
        )
        closing.callback(producer.shutdown)
        parts = replace(parts, producer=producer, source=AsyncRollout(producer))

    stopped_by = None
    saves = checkpoint.BackgroundSaves() if cfg.trainer.async_save else None
    stop.armed = True  # from here a Ctrl-C / SIGTERM stops at the next step boundary
    for step in range(state.step + 1, cfg.trainer.steps + 1):
        stop.step = step
        metrics = rl_step(parts, step, first_step=state.step + 1)
        problem = fidelity_problem(parts.guard, step, metrics)  # collective: every rank stops together
        if problem is not None:
            if log is not None:
                log.log(step, metrics)  # the row that crossed the threshold, not checkpointed
            raise FidelityStop(problem)
        if evaluating and (step % cfg.data.eval_every == 0 or step == cfg.trainer.steps):
            parts.memory.for_rollout()
            if rank0:
                metrics.update(parts.evaluate(step))
        saved = cfg.trainer.save_every and step % cfg.trainer.save_every == 0 or step == cfg.trainer.steps
        if saved:
            metrics["time/checkpoint"] = _save(parts, plan, stop, step, metrics if rank0 else None, saves)
        if log is not None:
            log.log(step, metrics)
        stopped_by = stop.agreed() if step < cfg.trainer.steps else None  # collective: every rank stops together
        if stopped_by is not None:
            save_now = cfg.trainer.save_on_interrupt and not saved
            if save_now:
                _save(parts, plan, stop, step, None, saves)  # the row is in metrics.jsonl already
            _finish_save(saves, stop)
            if rank0:
                print(stop.stopped_message(step, saved_now=save_now), flush=True)
            break
    _finish_save(saves, stop)
    plots = log.close() if log is not None else []
    return TrainResult(plan.output_dir, log.history if log is not None else [], plots, stopped_by=stopped_by)


def _build_parts(
    cfg: RLConfig, plan: run_dir.RunPlan, model_dir: Path, dims: ModelDims, closing: ExitStack
) -> tuple[StepParts, RunState, RunLog | None]:
    """The step's parts, the state to continue from (step, warm-up done, data position, metrics row) and rank 0's
    run log (metrics, plots, samples; its last row restored on a resume)."""
    tokenizer = load_tokenizer(cfg, dims.vocab_size)
    hf = read_hf_config(model_dir)
    check_teacher(cfg, tokenizer, hf)
    cfg = serve_side_models(cfg, closing)  # rank 0 launches the side models without urls; side: names resolved
    teacher = teacher_engine(cfg, closing) if dist.get_rank() == 0 else None  # distillation by a local engine
    data = prompt_data(cfg, tokenizer, teacher)  # before the model build: the sequences must fit the model's positions
    positions = max_positions(hf)
    check_positions(cfg, data, positions)
    if cfg.warmup.sft_steps > 0:  # the SFT rows are read, and a bad or too long one refused, before the model build
        check_warmup_data(data.sft_source(), positions)
    evaluator = Evaluator(data, tokenizer)  # its rewards resolved: an unknown one is refused before the build
    actor = build_actor(cfg, model_dir)
    critic = build_critic(cfg, model_dir, actor)
    rank0 = dist.get_rank() == 0
    engine = build_engine(cfg.rollout, engine_run(cfg), model_dir, platform.device()) if rank0 else NoEngine()
    closing.callback(engine.shutdown)
    state = RunState()
    if plan.resume_from is not None:
        state = RunState.from_saved(checkpoint.load_checkpoint(actor, plan.resume_from, critic=critic))
        data.load_state_dict(state.data)
    memory = ColocatedMemory(
        actor, engine, offload_actor=cfg.trainer.offload_actor, release_engine=cfg.rollout.release_memory,
        critic=critic,
    )  # fmt: skip
    source = SyncRollout(engine, data) if rank0 else NoRollout()  # async: replaced once warmed up
    log = None
    if rank0:
        log = RunLog(
            cfg.logging,
            plan.output_dir,
            cfg.trainer.steps,
            to_dict(cfg),
            first_step=plan.first_logged_step,
            wandb_id=plan.identity.run_id,
            samples=SampleLog(cfg.logging, plan.output_dir, tokenizer, first_step=plan.first_logged_step),
        )
        if plan.resume_from is not None and state.metrics_row is not None:
            log.restore_row(state.step, state.metrics_row)
    weights = WeightSync(actor, engine, cfg.rollout, build_verifier(cfg.rollout, data))
    parts = StepParts(
        cfg, actor, weights, None, data, tokenizer, build_rl_loss(cfg.algo), memory, source,
        samples_log=log.samples if log is not None else None,
        evaluator=evaluator if rank0 else None,
        guard=FidelityGuard(stop_rules(cfg)[0]), critic=critic,
        value_loss=build_value_loss(cfg.algo.critic.value_clip) if critic is not None else None,
    )  # fmt: skip
    return parts, state, log


def fidelity_problem(guard: FidelityGuard, step: int, metrics: dict[str, float]) -> str | None:
    """Collective: rank 0's verdict on step `step`'s metrics under `trainer.stop_on` (the message, or None)."""
    if not guard.rules:
        return None
    return broadcast_object(guard.problem(step, metrics) if dist.get_rank() == 0 else None)


def build_actor(cfg: RLConfig, model_dir: Path) -> MegatronActor:
    """The trained model and its optimizer, from `model_dir` (seeded; `trainer.cpu_threads` on CPU)."""
    if cfg.trainer.cpu_threads and platform.device().type == "cpu":
        torch.set_num_threads(cfg.trainer.cpu_threads)
    torch.manual_seed(cfg.trainer.seed)
    return MegatronActor.from_hf(
        model_dir,
        cfg.parallel,
        model_options=cfg.model.options,
        optimizer_options=cfg.optimizer,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        balance_quadratic=cfg.trainer.balance_quadratic,
        lora=cfg.model.lora,
    )


def build_critic(cfg: RLConfig, model_dir: Path, actor: MegatronActor) -> MegatronCritic | None:
    """With `algo.advantage: gae`, the value model in the actor's layout: `algo.critic.hf_path` (the policy's
    checkpoint with a fresh head when null), trained at `algo.critic.lr` with the rest of `optimizer`'s settings."""
    options = cfg.algo.critic
    if cfg.algo.advantage != GAE:
        return None
    critic = MegatronCritic.from_hf(
        options.hf_path or model_dir, cfg.parallel, model_options=cfg.model.options,
        optimizer_options=replace(cfg.optimizer, lr=options.lr, min_lr=min(cfg.optimizer.min_lr, options.lr)),
        micro_batch_tokens=cfg.trainer.micro_batch_tokens, balance_quadratic=cfg.trainer.balance_quadratic,
    )  # fmt: skip
    if critic.dims.vocab_size != actor.dims.vocab_size:
        raise ValueError(
            f"algo.critic.hf_path={options.hf_path}: vocabulary of {critic.dims.vocab_size} tokens, the policy's has "
            f"{actor.dims.vocab_size}; the critic must read the policy's tokens (same tokenizer)"
        )
    return critic


def warm_up_critic(parts: StepParts) -> None:
    """`algo.critic.warmup_steps` rollout steps that train the critic alone before the actor's first update (VAPO's
    value pre-training), numbered 1 - n .. 0 (their sampling seeds and plans differ from the RL steps'); rank 0
    prints each one's fit."""
    n = parts.cfg.algo.critic.warmup_steps
    for i in range(1, n + 1):
        metrics = rl_step(parts, i - n, first_step=1 - n, critic_only=True)
        if dist.get_rank() == 0:
            fit = ", ".join(f"{k.split('/')[1]} {metrics[k]:.4g}" for k in CRITIC_WARMUP_SHOWN if k in metrics)
            print(f"critic warm-up {i}/{n}: {fit}", flush=True)


CRITIC_WARMUP_SHOWN = ("critic/vf_loss", "critic/explained_variance", "critic/values_mean", "critic/returns_mean")


def _prepare_policy(parts: StepParts, state: RunState, model_dir: Path, warmed_up: Path, warmup: WarmupRun) -> bool:
    """The supervised warm-up (once per run, continued from a mid-SFT checkpoint; its result is kept in HF format
    in `warmed_up`). False when a signal stopped it."""
    cfg, actor = parts.cfg, parts.actor
    if not state.sft_done and cfg.warmup.sft_steps > 0:
        parts.memory.for_training()
        if not run_warmup(cfg, actor, parts.data, state, warmup):
            return False
        actor.reset_optimizer_state()
        save_hf_checkpoint(actor, warmed_up, model_dir, bucket_mb=cfg.rollout.bucket_mb)  # LoRA: merged
        if actor.lora is not None:  # and the adapters alone: the KL reference's (`_reference`)
            experts = actor.family.weight_map(actor.hf_config).num_experts
            save_peft_adapter(actor.chunks, actor.lora, experts, warmed_up / WARMUP_ADAPTER, str(model_dir),
                              for_peft=False)  # fmt: skip
        state.sft_done = True
    return True


def _reference(cfg: RLConfig, actor: MegatronActor, model_dir: Path, warmed_up: Path) -> FrozenScorer | None:
    """The KL reference (with `algo.kl_coef` > 0): the policy RL starts from, the warmed-up model, else the initial
    one."""
    if cfg.algo.kl_coef <= 0:
        return None
    if actor.lora is not None:  # the frozen base with the adapters RL starts from (none: the base itself)
        start = warmed_up / WARMUP_ADAPTER if cfg.warmup.sft_steps > 0 else cfg.model.lora.init_from
        return AdapterReference(actor, cfg.model.lora, Path(start) if start else None)
    return reference_from_hf(actor, warmed_up if cfg.warmup.sft_steps > 0 else model_dir)


def _teacher_weights(cfg: RLConfig, actor: MegatronActor) -> FrozenScorer | None:
    """The distillation teacher served by Megatron (`algo.distill.served_by: megatron`): its shard on the host (the
    student's architecture), else a second model resident in the actor's layout (`teacher.teacher_from_hf`)."""
    distill = cfg.algo.distill
    return teacher_from_hf(actor, distill.teacher) if distill.teacher and distill.served_by == "megatron" else None


def _first_sync(parts: StepParts, state: RunState) -> None:
    """The engine gets the policy RL starts (or continues) from."""
    parts.memory.for_training()  # before the first sync: the engine's launch weights are replaced anyway
    parts.memory.for_weight_sync()
    parts.weights.send(state.step)


def _save(
    parts: StepParts,
    plan: run_dir.RunPlan,
    stop: StopSignals,
    step: int,
    row: dict | None,
    saves: checkpoint.BackgroundSaves | None,
) -> float:
    """Checkpoint `step`; its metrics row goes into the checkpoint, so a crash between publishing the checkpoint
    and writing the row to metrics.jsonl loses nothing (the resumed run restores the row). With `saves` the
    tensors are written in the background and published when the next save (or `_finish_save`) waits for them.
    Seconds the loop was held up (a background save: waiting for the previous one, and the snapshot)."""
    parts.memory.for_training(keep_engine_weights=True)
    t = time.perf_counter()
    # Async mode: the producer's generated, untrained batches and the prompt position after them.
    rollout = parts.producer.checkpoint_state() if parts.producer is not None else {"data": parts.data.state_dict()}
    with stop.writing(f"checkpoint of step {step}"):
        checkpoint.save_checkpoint(
            parts.actor,
            plan.checkpoint_root,
            step,
            RunState(step=step, sft_done=True, metrics_row=row, **rollout).saved(),
            keep_last=parts.cfg.trainer.keep_last or 10**9,
            run_id=plan.identity.run_id,
            background=saves,
            critic=parts.critic,
        )
        stop.last_checkpoint = step if saves is None else saves.published
    return time.perf_counter() - t


def _finish_save(saves: checkpoint.BackgroundSaves | None, stop: StopSignals) -> None:
    """Collective: wait for the background save in flight, if any, publish it and end the writer (before the run
    returns)."""
    if saves is not None:
        with stop.writing("checkpoint being written in the background"):
            saves.close()
            stop.last_checkpoint = saves.published


# ---------------------------------------------------------------------------------------------- parts
def prepare_model_dir(cfg: RLConfig) -> Path:
    """The HF model directory; the tiny demo model is built there on first use when asked to."""
    path = Path(cfg.model.hf_path)
    if not (path / "config.json").is_file():
        if not cfg.model.build_tiny_if_missing:
            raise FileNotFoundError(f"model.hf_path={path} has no config.json (set model.build_tiny_if_missing?)")
        from megatron_rl.tiny_model import make_tiny_qwen3_moe

        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("build the tiny model once in a single process before a multi-rank run")
        make_tiny_qwen3_moe(path, seed=cfg.trainer.seed)
    return path


def load_tokenizer(cfg: RLConfig, model_vocab: int) -> Any:
    """The run's tokenizer, refused unless it is the model's (`input_guards.check_tokenizer`)."""
    from transformers import AutoTokenizer

    path = cfg.model.tokenizer_path or cfg.model.hf_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    check_tokenizer(tokenizer, path, cfg.model.hf_path, model_vocab)
    return tokenizer
