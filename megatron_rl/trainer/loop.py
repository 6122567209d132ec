"""The RL training loop, explicit: rollout -> rewards -> advantages -> old/ref log-probs -> updates -> sync.

Read top to bottom: `train(cfg)` sets up the parts, optionally warms the policy up with supervised
steps, then runs `trainer.steps` RL steps. Rank 0 owns the rollout engine (colocated, in-process) and
broadcasts each step's samples to every rank; all ranks train.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.algorithms import compute_advantages, kl_penalty
from megatron_rl.config import dump_yaml, format_config, to_dict
from megatron_rl.config.schema import RLConfig
from megatron_rl.megatron_backend import checkpoint, platform
from megatron_rl.megatron_backend.actor import MegatronActor
from megatron_rl.megatron_backend.batch import TokenBatch
from megatron_rl.megatron_backend.dist_checkpoint_files import check_checkpoint_files
from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
from megatron_rl.megatron_backend.hf_export import save_hf_checkpoint
from megatron_rl.megatron_backend.hf_weights import read_hf_config
from megatron_rl.megatron_backend.models import get_family
from megatron_rl.megatron_backend.reference import reference_from_hf
from megatron_rl.rollout.engine import RolloutEngineError
from megatron_rl.routing.agreement import mean_route_metrics
from megatron_rl.routing.cache import RouteCache
from megatron_rl.trainer import run_dir
from megatron_rl.trainer.colocation import ColocatedMemory
from megatron_rl.trainer.rl_batch import samples_to_batch, select
from megatron_rl.trainer.rl_loss import build_rl_loss, sft_loss
from megatron_rl.trainer.run_log import RunLog, run_header
from megatron_rl.trainer.stop_signals import StopSignals


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
        dims = get_family(hf).dims(hf)
        init_distributed(
            cfg.parallel,
            seed=cfg.trainer.seed,
            num_layers=dims.num_layers,
            num_experts=dims.num_experts,
            num_attention_heads=dims.num_attention_heads,
            num_query_groups=dims.num_query_groups,
        )
        rank0 = stop.announce = dist.get_rank() == 0
        engines: list = []  # the rollout engine once built: shut down however the run ends
        try:
            # Rank 0 decides how this start uses output_dir, before the model is built; every rank gets the verdict.
            plan = broadcast_object(_plan_or_error(cfg) if rank0 else None)
            if isinstance(plan, Exception):
                raise plan
            if plan.complete:
                if rank0:
                    print("\n".join([*plan.notes, plan.complete_message()]), flush=True)
                return TrainResult(output_dir, [], [], already_complete=True)
            if rank0:
                run_dir.start_run(plan)
            dist.barrier()
            stop.last_checkpoint = plan.start_step if plan.resume_from is not None else None
            return _setup_and_loop(cfg, plan, model_dir, dims, stop, engines, verbose)
        finally:
            for engine in engines:
                engine.shutdown()
            shutdown()


def _plan_or_error(cfg: RLConfig) -> run_dir.RunPlan | Exception:
    try:
        plan = run_dir.plan_run(cfg)
        if plan.resume_from is not None and not plan.complete:  # a damaged checkpoint is named before the build
            check_checkpoint_files(plan.resume_from)
        return plan
    except ValueError as err:  # reported by every rank alike
        return err


def _setup_and_loop(
    cfg: RLConfig, plan: run_dir.RunPlan, model_dir: Path, dims, stop: StopSignals, engines: list, verbose: bool
) -> TrainResult:
    output_dir = plan.output_dir
    rank0 = dist.get_rank() == 0
    tokenizer = load_tokenizer(cfg, dims.vocab_size)
    torch.manual_seed(cfg.trainer.seed)
    actor = MegatronActor.from_hf(
        model_dir,
        cfg.parallel,
        model_options=cfg.model.options,
        optimizer_options=cfg.optimizer,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
    )
    data = PromptData(cfg, tokenizer)
    engine = build_engine(cfg, model_dir) if rank0 else None
    if engine is not None:
        engines.append(engine)
    ckpt_root = plan.checkpoint_root
    state = {"step": 0, "sft_done": False, "data": None}
    if plan.resume_from is not None:
        state = checkpoint.load_checkpoint(actor, plan.resume_from)
        data.load_state_dict(state["data"])
    if rank0:
        dump_yaml(cfg, output_dir / "config.yaml")
        print(format_config(cfg) if verbose else run_header(cfg, dims, plan.resume_from, state["step"]), flush=True)
    log = None
    if rank0:
        log = RunLog(
            cfg.logging,
            output_dir,
            cfg.trainer.steps,
            to_dict(cfg),
            first_step=plan.first_logged_step,
            wandb_id=plan.identity.run_id,
        )
        if plan.resume_from is not None and state.get("metrics_row") is not None:
            log.restore_row(state["step"], state["metrics_row"])

    memory = ColocatedMemory(
        actor, engine, offload_actor=cfg.trainer.offload_actor, release_engine=cfg.rollout.release_memory
    )
    warmed_up = output_dir / "warmup_model"  # the policy after the supervised stage, in HF format
    if not state["sft_done"] and cfg.warmup.sft_steps > 0:
        memory.for_training()
        supervised_warmup(cfg, actor, data, log)
        actor.reset_optimizer_state()
        save_hf_checkpoint(actor, warmed_up, model_dir, bucket_mb=cfg.rollout.bucket_mb)
        state["sft_done"] = True
    # The KL reference is the policy RL starts from: the warmed-up model, else the initial one.
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = reference_from_hf(actor, warmed_up if cfg.warmup.sft_steps > 0 else model_dir)
    memory.for_training()  # before the first sync: the engine's launch weights are replaced anyway
    memory.for_weight_sync()
    if engine is not None or not rank0:
        sync_weights(actor, engine, cfg, version=f"step-{state['step']}")
    loss_fn = build_rl_loss(cfg.algo)
    if state["step"] == 0 and cfg.data.eval and cfg.data.eval_every:
        memory.for_rollout()
        if log is not None:
            log.log(0, evaluate(cfg, engine, data, tokenizer))  # the starting point of the curve

    def save(step: int, row: dict[str, float] | None) -> float:
        """Checkpoint `step`; its metrics row goes into the checkpoint, so a crash between publishing the checkpoint
        and writing the row to metrics.jsonl loses nothing (the resumed run restores the row)."""
        memory.for_training(keep_engine_weights=True)
        t = time.perf_counter()
        with stop.writing(f"checkpoint of step {step}"):
            checkpoint.save_checkpoint(
                actor,
                ckpt_root,
                step,
                {"step": step, "sft_done": True, "data": data.state_dict(), "metrics_row": row},
                keep_last=cfg.trainer.keep_last or 10**9,
                run_id=plan.identity.run_id,
            )
            stop.last_checkpoint = step
        return time.perf_counter() - t

    stopped_by = None
    stop.armed = True  # from here a Ctrl-C / SIGTERM stops at the next step boundary
    for step in range(state["step"] + 1, cfg.trainer.steps + 1):
        stop.step = step
        metrics = rl_step(cfg, step, actor, engine, reference, data, tokenizer, loss_fn, memory)
        if cfg.data.eval and cfg.data.eval_every and (step % cfg.data.eval_every == 0 or step == cfg.trainer.steps):
            memory.for_rollout()
            if rank0:
                metrics.update(evaluate(cfg, engine, data, tokenizer))
        saved = cfg.trainer.save_every and step % cfg.trainer.save_every == 0 or step == cfg.trainer.steps
        if saved:
            metrics["time/checkpoint"] = save(step, metrics if rank0 else None)
        if log is not None:
            log.log(step, metrics)
        stopped_by = stop.agreed() if step < cfg.trainer.steps else None  # collective: every rank stops together
        if stopped_by is not None:
            save_now = cfg.trainer.save_on_interrupt and not saved
            if save_now:
                save(step, None)  # the row is in metrics.jsonl already
            if rank0:
                print(stop.stopped_message(step, saved_now=save_now), flush=True)
            break
    plots = log.close() if log is not None else []
    return TrainResult(output_dir, log.history if log is not None else [], plots, stopped_by=stopped_by)


# ---------------------------------------------------------------------------------------------- one RL step
def rl_step(
    cfg: RLConfig, step: int, actor, engine, reference, data, tokenizer, loss_fn, memory: ColocatedMemory
) -> dict[str, float]:
    algo, timings = cfg.algo, {}
    t0 = time.perf_counter()

    # 1. Rollout with rewards (and dynamic sampling) on rank 0, shared with every rank. Colocated: the engine
    #    holds the accelerator (memory.for_rollout), then hands it to the trainer (memory.for_training).
    memory.for_rollout()
    samples, rollout_metrics = collect_rollout(cfg, step, actor, engine, data, memory)
    memory.for_training()
    timings["time/rollout"] = time.perf_counter() - t0
    if not samples:  # dynamic sampling kept no group within its tries: nothing to learn from this step
        if cfg.rollout.release_memory:  # the released engine weights are gone: re-send the unchanged ones
            memory.for_weight_sync()
            try:
                sync_weights(actor, engine, cfg, version=f"step-{step - 1}")
            except RolloutEngineError as err:  # rank 0 only; the next rollout restarts the server
                print(f"step {step}: weight sync failed ({err}); recovering at the next rollout", flush=True)
        return {**rollout_metrics, **timings, **memory.pop_metrics(), "time/step": time.perf_counter() - t0}

    # 2. Advantages from the group-structured rewards.
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    advantages = compute_advantages(
        algo.advantage, rewards, cfg.rollout.n_samples, **advantage_options(algo.advantage, algo.norm_adv_by_std)
    )
    batch = samples_to_batch(samples, advantages=advantages)

    # 3. Mini-batches of the first epoch are fixed now: old-policy log-probs are computed on exactly the
    #    micro-batches the first update trains on, so its new/old ratio is bitwise 1 (ppo_kl == 0).
    #    Routes (R2: recorded here; R3: the rollout engine's) live in a host cache holding only the samples
    #    this data-parallel rank feeds, and are sliced per mini-batch.
    epochs = [mini_batch_partition(cfg, step, epoch, batch.size) for epoch in range(algo.ppo_epochs)]
    t = time.perf_counter()
    r2, r3 = algo.routing_replay == "R2", algo.routing_replay == "R3"
    routes = RouteShard(actor, epochs) if r2 or r3 else None
    if r3:
        routes.put_rollout(samples)
    batch.fields["old_log_probs"] = torch.zeros_like(batch.fields["loss_mask"])
    entropy = torch.zeros_like(batch.fields["loss_mask"])
    rollout_routing = []  # R3: the rollout engine's routes vs the routes the trainer's weights choose
    for part in epochs[0]:
        mb = routes.attach(select(batch, part), part) if r3 else select(batch, part)
        scored = actor.compute_log_probs(mb, with_entropy=True, record_routes=r2, replay_routes=r3)
        if r3 and actor.last_route_agreement is not None:
            rollout_routing.append(actor.last_route_agreement.as_metrics("routing/rollout_", actor.dims.moe_layers))
        batch.fields["old_log_probs"][part] = scored.log_probs
        entropy[part] = scored.entropy
        if r2:
            routes.put_recorded(part, scored.routes, batch.lengths[part])
    if reference is not None:  # on the same micro-batches too: policy == reference gives KL exactly 0
        batch.fields["ref_log_probs"] = torch.zeros_like(batch.fields["loss_mask"])
        with reference.swapped_in() as ref_actor:
            for part in epochs[0]:
                batch.fields["ref_log_probs"][part] = ref_actor.compute_log_probs(select(batch, part)).log_probs
    timings["time/old_logp"] = time.perf_counter() - t
    metrics = {**rollout_metrics, **mismatch_metrics(batch, batch.fields["old_log_probs"], entropy)}
    if routes is not None:
        metrics.update(routes.metrics())

    # 4. Mini-batch updates; the first one is on-policy, so its ratio must be exactly 1.
    t = time.perf_counter()
    mini_batches = [part for parts in epochs for part in parts]
    updates = [
        actor.train_step(
            routes.attach(select(batch, part), part) if routes else select(batch, part),
            loss_fn,
            with_entropy=True,
            replay_routes=routes is not None,
            on_nonfinite=cfg.trainer.on_nonfinite,
            where=f"step {step}, update {i + 1} of {len(mini_batches)}",
        )
        for i, part in enumerate(mini_batches)
    ]
    # Updates dropped for a NaN/inf loss or gradient (trainer.on_nonfinite=skip) are counted, not averaged.
    applied = [u for u in updates if not u.pop("nonfinite_skipped", 0.0)]
    metrics["actor/nonfinite_skipped"] = float(len(updates) - len(applied))
    updates = applied or updates
    # Replayed routes vs the routes each update's weights would choose (routing.agreement), mean over updates.
    routing = [{k: u.pop(k) for k in list(u) if k.startswith("routing/")} for u in updates]
    metrics.update(_mean_metrics(updates))
    if algo.routing_replay != "off":
        metrics.update(mean_route_metrics(routing + rollout_routing))
    metrics["actor/ppo_kl_first"] = updates[0].get("actor/ppo_kl", 0.0)
    metrics["actor/grad_norm"] = updates[-1]["grad_norm"]
    metrics["actor/lr"] = updates[-1]["lr"]
    timings["time/train"] = time.perf_counter() - t

    # 5. Weight sync to the rollout engine.
    t = time.perf_counter()
    memory.for_weight_sync()
    try:
        sync_weights(actor, engine, cfg, version=f"step-{step}")
    except RolloutEngineError as err:  # rank 0 only; the next rollout restarts the server and re-sends weights
        print(f"step {step}: weight sync failed ({err}); recovering at the next rollout", flush=True)
    timings["time/weight_sync"] = time.perf_counter() - t
    timings["time/step"] = time.perf_counter() - t0
    metrics.update(timings)
    metrics.update(memory.pop_metrics())
    metrics["perf/tokens_per_s"] = float(batch.lengths.sum()) / timings["time/step"]
    return metrics


def collect_rollout(
    cfg: RLConfig, step: int, actor, engine, data, memory: ColocatedMemory
) -> tuple[list, dict[str, float]]:
    """Rank 0 collects the step's samples and shares them. When a rollout server dies or hangs, the engine
    restarts it, every rank re-sends the current weights and the step's rollout is retried from the same
    prompt position (at most `rollout.restarts_per_step` times)."""
    restarts = 0
    while True:
        outcome: Any = None
        if engine is not None:
            position = data.state_dict()
            try:
                rollout = data.collect(engine, step)
                outcome = (rollout.samples, {**rollout_metrics_of(rollout, cfg), "rollout/restarts": restarts})
            except RolloutEngineError as err:
                outcome = err
                if restarts < cfg.rollout.restarts_per_step:
                    try:
                        restarted = engine.recover()
                        print(f"step {step}: rollout failed ({err}); restarted {restarted or 'nothing'}, retrying",
                              flush=True)  # fmt: skip
                        data.load_state_dict(position)
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
        try:
            sync_weights(actor, engine, cfg, version=f"step-{step - 1}")  # collective: every rank exports
        except RolloutEngineError as err:  # rank 0 only: the engine is stale, the next try fails and counts
            print(f"step {step}: re-sending the weights failed ({err})", flush=True)
        memory.for_rollout()


class RouteShard:
    """This data-parallel rank's routes of one step's batch (R2/R3), in a compact host `RouteCache`.

    The actor feeds rows `rank, rank + dp, ...` of every mini-batch it is given, so a rank needs the routes
    of exactly those samples, over all epochs' partitions; other ranks' rows get placeholder experts that
    are never fed."""

    def __init__(self, actor: MegatronActor, epochs: list[list[list[int]]]):
        from megatron.core import parallel_state as ps

        self.rank, self.size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.mine = {part[j] for parts in epochs for part in parts for j in range(self.rank, len(part), self.size)}
        dims = actor.dims
        self.cache = RouteCache(len(dims.moe_layers), dims.top_k, dims.num_experts)

    def put_rollout(self, samples: list) -> None:
        """R3: the engine's routes (SGLang layout) of this rank's samples."""
        for i in sorted(self.mine):
            if samples[i].routed_experts is None:
                raise ValueError(f"sample {i} has no routed_experts but routing replay R3 is on")
            self.cache.put(i, samples[i].routed_experts, num_tokens=len(samples[i].tokens))

    def put_recorded(self, part: list[int], recorded: torch.Tensor, lengths: torch.Tensor) -> None:
        """R2: the routes the old-policy pass recorded (`[rows, seq, layers, k]`), this rank's rows only."""
        # Keep every row the micro-batch fed (the last token's and its padding; unfed rows read as one
        # repeated expert), so the first update's replay re-runs the recording bitwise.
        ordered = recorded.sort(-1).values
        fed = (ordered[..., 1:] != ordered[..., :-1]).all(-1).all(-1)  # [rows, seq]
        for j, i in enumerate(part):
            if i in self.mine:
                n = int(lengths[j])
                width = max(n, int(fed[j].nonzero().max()) + 1 if fed[j].any() else n)
                self.cache.put(i, recorded[j, :width], num_tokens=n, recorded=True)

    def attach(self, mini_batch: TokenBatch, part: list[int]) -> TokenBatch:
        keys = [i if j % self.size == self.rank else None for j, i in enumerate(part)]
        mini_batch.routes = self.cache.batch_routes(keys, mini_batch.input_ids.shape[1])
        return mini_batch

    def metrics(self) -> dict[str, float]:
        tokens = sum(self.cache.get(k).shape[0] for k in self.mine if k in self.cache)
        return {
            "routing/cache_samples": float(len(self.cache)),
            "routing/cache_mib": self.cache.nbytes / 2**20,
            "routing/cache_bytes_per_token": self.cache.nbytes / max(tokens, 1),
        }


def mini_batch_partition(cfg: RLConfig, step: int, epoch: int, size: int) -> list[list[int]]:
    """Row indices of each mini-batch of one epoch (a seeded shuffle, the same on every rank)."""
    shuffle = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step * 1000 + epoch)
    order = torch.randperm(size, generator=shuffle)
    return [sorted(part.tolist()) for part in order.chunk(cfg.algo.mini_batches_per_step)]


def advantage_options(name: str, norm_by_std: bool) -> dict[str, Any]:
    return {"norm_by_std": norm_by_std} if name == "grpo" else {}


def rollout_metrics_of(rollout, cfg: RLConfig) -> dict[str, float]:
    """Rollout metrics; reward and accuracy are over every scored sample (dynamic sampling keeps a
    biased subset), lengths over the kept ones."""
    samples = rollout.samples
    groups = rollout.kept_groups + rollout.dropped_groups + rollout.aborted_groups
    metrics = {
        "rollout/reward_mean": float(rollout.reward_stats.mean),
        "rollout/filtered_group_frac": rollout.dropped_groups / max(groups, 1),
        "rollout/tries": float(rollout.tries),
        "rollout/batch_filled": float(rollout.filled),
        "rollout/reward_errors": float(rollout.reward_stats.errors + rollout.reward_stats.timeouts),
        "rollout/samples": float(len(samples)),
    }
    if samples:
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        task = torch.tensor([s.metadata.get("task_reward", s.reward) for s in samples], dtype=torch.float32)
        metrics.update(
            {
                "rollout/kept_reward_mean": float(rewards.mean()),
                "rollout/kept_reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                "rollout/kept_accuracy": float((task > 0.5).float().mean()),
                "rollout/response_len_mean": float(lengths.mean()),
                "rollout/response_len_max": float(lengths.max()),
                "rollout/truncated_frac": float(sum(s.truncated for s in samples) / len(samples)),
            }
        )
    return metrics


def mismatch_metrics(batch: TokenBatch, old_log_probs: torch.Tensor, entropy: torch.Tensor) -> dict[str, float]:
    """Trainer vs rollout-engine log-probs of the same response tokens: mean |diff| and k3 KL."""
    mask = batch.response_mask()
    trainer, engine = old_log_probs[mask], batch.fields["rollout_log_probs"][mask]
    return {
        "mismatch/logp_abs_diff": float((trainer - engine).abs().mean()),
        "mismatch/logp_abs_diff_max": float((trainer - engine).abs().max()),
        "mismatch/k3_kl": float(kl_penalty(engine, trainer, "k3").mean()),
        "actor/entropy_old": float(entropy[mask].mean()),
    }


def _mean_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*updates)
    return {
        k if k.startswith("actor/") else f"actor/{k}": sum(u.get(k, 0.0) for u in updates) / len(updates) for k in keys
    }


# ---------------------------------------------------------------------------------------------- parts
def supervised_warmup(cfg: RLConfig, actor: MegatronActor, data, log) -> None:
    """`warmup.sft_steps` supervised steps on prompt -> answer pairs (the synthetic task's SFT split)."""
    from tqdm import tqdm

    w = cfg.warmup
    bar = tqdm(range(w.sft_steps), desc="supervised warm-up", disable=dist.get_rank() != 0)
    for k in bar:
        pairs = data.sft_pairs(w.sft_batch_size, start=k * w.sft_batch_size)
        batch = pairs_to_batch(pairs)
        metrics = actor.train_step(batch, sft_loss, lr=w.sft_lr)
        bar.set_postfix(nll=f"{metrics['sft/nll']:.3f}")


def pairs_to_batch(pairs) -> TokenBatch:
    lengths = [len(p.prompt_ids) + len(p.response_ids) for p in pairs]
    ids = torch.zeros(len(pairs), max(lengths), dtype=torch.long)
    for i, p in enumerate(pairs):
        ids[i, : lengths[i]] = torch.tensor(p.prompt_ids + p.response_ids)
    return TokenBatch(ids, torch.tensor(lengths), torch.tensor([len(p.prompt_ids) for p in pairs]))


def evaluate(cfg: RLConfig, engine, data, tokenizer) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts."""
    from megatron_rl.rollout.rewards import compute_rewards

    prompts = data.eval_prompts(cfg.data.eval_prompts)
    params = replace(cfg.rollout.sampling, temperature=0.0)
    samples = engine.generate([p.token_ids for p in prompts], params, n=1)
    for s, p in zip(samples, prompts, strict=True):
        s.metadata.update(p.metadata, prompt=p.text, answer=p.answer)
    compute_rewards(samples, data.reward_fn, tokenizer, timeout_s=cfg.data.reward_timeout_s)
    return {"eval/accuracy": sum(s.reward > 0.5 for s in samples) / len(samples)}


def sync_weights(actor: MegatronActor, engine, cfg: RLConfig, *, version: str) -> None:
    """Stream the actor's weights (HF names) into the rollout engine (collective: every rank exports)."""
    buckets = actor.export_hf(bucket_bytes=cfg.rollout.bucket_mb << 20)
    if engine is None:
        for _ in buckets:
            pass
        return
    try:
        engine.update_weights(buckets, version)
    except RolloutEngineError:
        for _ in buckets:  # the other ranks are still exporting: finish the collective before raising
            pass
        raise


def broadcast_object(obj: Any) -> Any:
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


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


def load_tokenizer(cfg: RLConfig, model_vocab: int):
    from transformers import AutoTokenizer

    path = cfg.model.tokenizer_path or cfg.model.hf_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) > model_vocab:
        raise ValueError(
            f"tokenizer at {path} has {len(tokenizer)} tokens but the model's vocabulary has {model_vocab}: "
            "the tokenizer does not match the model (set model.tokenizer_path to the model's own tokenizer)"
        )
    return tokenizer


def build_engine(cfg: RLConfig, model_dir: Path):
    """The rollout engine: in-process transformers (`local`) or SGLang servers (connected to or launched)."""
    if cfg.rollout.engine == "local":
        from megatron_rl.rollout.local_engine import LocalEngine

        return LocalEngine(model_dir, device=platform.device(), weight_version="step-0")
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.rollout.sglang_server import SGLangLaunchConfig, SGLangServers
    from megatron_rl.rollout.weight_sync import make_weight_sync

    sg = cfg.rollout.sglang
    if cfg.rollout.release_memory and platform.device().type != "cuda":
        raise ValueError(
            "rollout.release_memory=true with rollout.engine=sglang needs GPUs: SGLang frees memory with "
            "torch_memory_saver (CUDA only), and its CPU server exits on /release_memory_occupation; set "
            "rollout.release_memory=false here"
        )
    from megatron_rl.rollout.api_key import client_api_key, launch_api_key_file

    if sg.urls:
        api_key = client_api_key(sg.api_key_file, sg.api_key_env)
        servers = SGLangServers.connect(list(sg.urls), router_url=sg.router_url or None, api_key=api_key)
    else:
        flags = ["--tp-size", str(sg.tp_size), "--ep-size", str(sg.ep_size)]
        flags += ["--mem-fraction-static", str(sg.mem_fraction_static)]
        if cfg.algo.routing_replay == "R3":
            flags.append("--enable-return-routed-experts")
        if cfg.rollout.release_memory:
            flags.append("--enable-memory-saver")
        servers = SGLangServers.launch(
            SGLangLaunchConfig(
                model_path=str(model_dir),
                python=sg.python,
                num_servers=sg.num_servers,
                ports=tuple(sg.base_port + i for i in range(sg.num_servers)),
                extra_args=(*flags, *sg.extra_args),
                log_dir=str(Path(cfg.trainer.output_dir) / "sglang_logs"),
                startup_timeout_s=sg.startup_timeout_s,
                router=sg.router,
                router_policy=sg.router_policy,
                api_key_file=str(launch_api_key_file(sg.api_key_file, cfg.trainer.output_dir)),
            )
        )
    weight_sync = make_weight_sync(cfg.rollout.weight_sync, tp_size=sg.tp_size, master_address=sg.trainer_address)
    return SGLangEngine(servers, weight_sync=weight_sync, request_timeout_s=sg.request_timeout_s)


class PromptData:
    """Training and evaluation prompts, the reward, and the resumable position in the prompt stream."""

    def __init__(self, cfg: RLConfig, tokenizer):
        from megatron_rl.rollout.rewards import get_reward

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.reward_fn = get_reward(cfg.data.reward)
        self.task = None
        self.train_iter = None
        if cfg.data.train == "synthetic":
            from megatron_rl.rollout.synthetic_task import SyntheticTask

            self.task = SyntheticTask(seed=cfg.trainer.seed, tokenizer=tokenizer)
            self.stream = self.task.stream()
        else:
            from megatron_rl.rollout.prompts import PromptIterator, load_prompts

            prompts = load_prompts(
                cfg.data.train,
                tokenizer,
                prompt_key=cfg.data.prompt_key,
                answer_key=cfg.data.answer_key,
                apply_chat_template=cfg.data.apply_chat_template,
            )
            self.train_iter = PromptIterator(prompts, seed=cfg.trainer.seed)
            self.stream = self.train_iter

    def collect(self, engine, step: int):
        """One step's rollout batch; sampling is seeded per step so a resumed run draws the same samples."""
        from megatron_rl.rollout.dynamic_sampling import OverlongOptions, collect_batch

        algo, rollout = self.cfg.algo, self.cfg.rollout
        overlong = None
        if algo.overlong_buffer > 0 or algo.overlong_filter:
            overlong = OverlongOptions(
                max_len=rollout.sampling.max_new_tokens,
                cache_len=algo.overlong_buffer,
                factor=algo.overlong_penalty_factor if algo.overlong_buffer > 0 else 0.0,
                filter_truncated=algo.overlong_filter,
            )
        return collect_batch(
            engine,
            self.stream,
            rollout.n_samples,
            rollout.prompts_per_step,
            replace(rollout.sampling, seed=(rollout.sampling.seed or self.cfg.trainer.seed) * 100_003 + step),
            self.reward_fn,
            tokenizer=self.tokenizer,
            dynamic_sampling=algo.dynamic_sampling,
            max_tries=algo.max_dynamic_tries,
            overlong=overlong,
            reward_timeout_s=self.cfg.data.reward_timeout_s,
            return_routed_experts=algo.routing_replay == "R3",
        )

    def eval_prompts(self, n: int):
        if self.cfg.data.eval == "synthetic":
            return self.task.eval_prompts(n) if self.task is not None else _synthetic(self).eval_prompts(n)
        from megatron_rl.rollout.prompts import load_prompts

        return load_prompts(
            self.cfg.data.eval,
            self.tokenizer,
            prompt_key=self.cfg.data.prompt_key,
            answer_key=self.cfg.data.answer_key,
            apply_chat_template=self.cfg.data.apply_chat_template,
        )[:n]

    def sft_pairs(self, n: int, *, start: int):
        if self.task is None:
            raise ValueError("warmup.sft_steps needs data.train: synthetic (no SFT data for other datasets yet)")
        return self.task.sft_pairs(n, start=start)

    def state_dict(self) -> dict:
        return {
            "synthetic": self.task.state_dict() if self.task else None,
            "prompts": self.train_iter.state_dict() if self.train_iter else None,
        }

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        if self.task is not None and state.get("synthetic"):
            self.task.load_state_dict(state["synthetic"])
        if self.train_iter is not None and state.get("prompts"):
            self.train_iter.load_state_dict(state["prompts"])


def _synthetic(data: PromptData):
    from megatron_rl.rollout.synthetic_task import SyntheticTask

    return SyntheticTask(seed=data.cfg.trainer.seed, tokenizer=data.tokenizer)
