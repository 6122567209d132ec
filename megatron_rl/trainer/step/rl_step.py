"""One RL step, explicit: rollout -> rewards -> advantages -> old/ref log-probs (-> the critic's values and GAE) ->
updates (the actor's, then the critic's) -> weight sync. `StepParts` is what a step works with (`loop.train`
builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.config.schema import RLConfig
from megatron_rl.evaluation.runner import Evaluator
from megatron_rl.megatron_backend.actor.batch import LossFn
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.actor.teacher import FrozenScorer
from megatron_rl.megatron_backend.critic.value_model import MegatronCritic
from megatron_rl.rollout.data import PromptData
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.routing.replay import ReplayChecks
from megatron_rl.trainer.async_rollout import RolloutProducer
from megatron_rl.trainer.colocation import ColocatedMemory
from megatron_rl.trainer.guards.fidelity_guard import FidelityGuard
from megatron_rl.trainer.logs.sample_log import SampleLog
from megatron_rl.trainer.rollout_phase import NoRollout, RolloutSource, WeightSync, collect_rollout
from megatron_rl.trainer.step.critic_phase import critic_advantages, critic_updates
from megatron_rl.trainer.step.old_policy_scores import distill_advantages, score_old_and_reference
from megatron_rl.trainer.step.policy_updates import first_update_scores_itself, run_updates
from megatron_rl.trainer.step.rl_batch import step_advantages
from megatron_rl.trainer.step.step_metrics import StepClock, training_metrics
from megatron_rl.trainer.step.step_plan import RankBatch, rank_batch


@dataclass(frozen=True)
class StepParts:
    """What an RL step works with. `weights` sends the actor's weights to rank 0's rollout engine (`NoEngine` on the
    other ranks). Built before the warm-up; the reference and async mode's producer, which need the warmed-up
    policy, join it after (`dataclasses.replace`)."""

    cfg: RLConfig
    actor: MegatronActor
    weights: WeightSync
    reference: FrozenScorer | None  # the KL reference: host-swapped weights (LoRA: the base, adapters off)
    data: PromptData
    tokenizer: Any
    loss_fn: LossFn
    memory: ColocatedMemory
    source: RolloutSource = NoRollout()  # rank 0: where its step batches come from (SyncRollout, AsyncRollout)
    teacher: FrozenScorer | None = None  # algo.distill.teacher served by Megatron (host-swapped or resident)
    producer: RolloutProducer | None = None  # async mode, rank 0
    samples_log: SampleLog | None = None  # rank 0: samples.jsonl / eval_samples.jsonl and the console excerpt
    evaluator: Evaluator | None = None  # rank 0, with data.eval: the evaluation datasets
    guard: FidelityGuard = field(default_factory=lambda: FidelityGuard([]))  # trainer.stop_on's rules
    critic: MegatronCritic | None = None  # algo.advantage=gae: the value model in the actor's layout
    value_loss: LossFn | None = None  # the critic's (`critic_phase.build_value_loss`)

    @property
    def requests(self) -> RolloutEngine:
        """The engine for requests outside the rollout (evaluation): through the producer's gate in async mode."""
        return self.producer.engine if self.producer is not None else self.weights.engine

    def evaluate(self, step: int) -> dict[str, float]:
        """Rank 0: the evaluation after step `step` (step 0: before any update), on the engine's current weights;
        its samples go to eval_samples.jsonl. In async mode the requests share the producer's gate, so the trainer
        waits only for the generation and scoring of the evaluation itself."""
        if self.evaluator is None:
            raise RuntimeError("evaluate() runs on rank 0, which holds the rollout engine, with data.eval set")
        log = self.samples_log
        return self.evaluator.evaluate(
            self.requests, step, on_samples=None if log is None else lambda name, s: log.add_eval(step, s, name)
        )



def rl_step(p: StepParts, step: int, first_step: int, *, critic_only: bool = False) -> dict[str, float]:
    """RL step `step`; `first_step` is the first step of this start (routing replay checks its alignment there).
    `critic_only`: a critic warm-up step (`algo.critic.warmup_steps`): rollout, values and the critic's updates,
    the actor left as it is (no update, no weight sync)."""
    cfg, clock, critic = p.cfg, StepClock(), p.critic

    # 1. Rollout with rewards (and dynamic sampling) on rank 0; every rank learns the samples' lengths and rewards.
    #    Colocated: the engine holds the accelerator (memory.for_rollout), then hands it to the trainer.
    with clock("time/rollout"):
        p.memory.for_rollout()
        rollout = collect_rollout(cfg.rollout.restarts_per_step, step, p.weights, p.source, p.memory)
        p.memory.for_training()
    if not rollout.lengths:  # dynamic sampling kept no group within its tries: nothing to learn from this step
        _keep_engine_in_step(p, step)
        return {**rollout.metrics, **clock.metrics(), **p.memory.pop_metrics(), **p.weights.pop_metrics()}

    # 2. Advantages from the group-structured rewards (every rank alike); with a critic, per token after step 3.
    if critic is None:
        advantages = step_advantages(cfg.algo, rollout.rewards, cfg.rollout.n_samples)
        shown: list[float | None] = advantages.tolist()
    else:
        advantages, shown = torch.zeros(len(rollout.rewards)), [None] * len(rollout.rewards)
    if p.samples_log is not None and rollout.samples is not None and not critic_only:  # rank 0
        p.samples_log.add_step(step, rollout.samples, shown)

    # 3. The step's plan, fixed for all its passes: its mini-batches and each data-parallel rank's rows of them.
    #    Rank 0 sends each rank only its rows (routes included); old-policy log-probs are computed on exactly the
    #    micro-batches the first update trains on, so its new/old ratio is bitwise 1 (ppo_kl == 0), or taken from
    #    that update's own forward on unchecked steps (`algo.first_update_check`, trainer/step/policy_updates.py).
    with clock("time/old_logp"):
        rank = rank_batch(cfg, step, rollout, advantages, p.actor.dims)
        replay = replay_checks(cfg, step, first_step)
        on_policy = first_update_scores_itself(cfg.algo, step, first_step, rank.routes, replay)
        entropy = None  # a critic warm-up step needs the old policy's scores only for algo.kl_in_reward
        if not critic_only or cfg.algo.kl_in_reward:
            entropy = score_old_and_reference(
                p.actor, p.reference, rank, replay, on_policy=on_policy, teacher=p.teacher,
                teacher_top_k=cfg.algo.distill.top_k,
            )  # fmt: skip
        distilled = distill_advantages(cfg.algo.distill, rank.batch) if cfg.algo.distill.teacher else {}
    if critic is not None:  # the old values, GAE advantages and returns (trainer/step/critic_phase.py)
        with clock("time/values"):
            distilled.update(critic_advantages(critic, cfg.algo, rank))
    if critic_only:
        return {**distilled, **_train_critic(p, rank, step, clock), **clock.metrics()}
    assert entropy is not None

    # 4. Mini-batch updates; the first one is on-policy, so its ratio must be exactly 1.
    with clock("time/train"):
        updates = run_updates(
            p.actor, p.loss_fn, rank, replay, entropy, on_policy=on_policy, step=step,
            on_nonfinite=cfg.trainer.on_nonfinite, skip_grad_norm_above=p.guard.skip_grad_norm_above,
        )  # fmt: skip
        metrics = {**rollout.metrics, **distilled, **training_metrics(rank, entropy, updates, on_policy=on_policy)}
    if critic is not None:
        metrics.update(_train_critic(p, rank, step, clock))

    # 5. Weight sync to the rollout engine (async mode: between the producer's requests, on its schedule).
    with clock("time/weight_sync"):
        p.memory.for_weight_sync()
        with p.source.updating(step):
            p.weights.send_or_defer(step, f"step {step}: weight sync")
    metrics.update({**clock.metrics(), **p.memory.pop_metrics(), **p.weights.pop_metrics()})
    metrics["perf/tokens_per_s"] = sum(rollout.lengths) / metrics["time/step"]
    return metrics


def _keep_engine_in_step(p: StepParts, step: int) -> None:
    """A step without an update: async mode's producer still expects the weights of version `step` (the same as
    `step - 1`'s); colocated with `rollout.release_memory`, the engine's released weights are sent again."""
    what = f"step {step}: weight sync"
    if p.cfg.trainer.mode == "async":
        with p.source.updating(step):
            p.weights.send_or_defer(step, what)
    elif p.cfg.rollout.release_memory:
        p.memory.for_weight_sync()
        p.weights.send_or_defer(step - 1, what)


def replay_checks(cfg: RLConfig, step: int, first_step: int) -> ReplayChecks:
    """What this step's replaying passes verify (`algo.replay_check`, `algo.replay_agreement_every`)."""
    algo = cfg.algo
    check = algo.replay_check == "every_step" or (algo.replay_check == "first_step" and step == first_step)
    every = algo.replay_agreement_every
    return ReplayChecks(check=check, agreement=every > 0 and step % every == 0)




def _train_critic(p: StepParts, rank: RankBatch, step: int | str, clock: StepClock) -> dict[str, float]:
    assert p.critic is not None and p.value_loss is not None
    with clock("time/critic_train"):
        return critic_updates(p.critic, p.value_loss, rank, step=step, on_nonfinite=p.cfg.trainer.on_nonfinite)
