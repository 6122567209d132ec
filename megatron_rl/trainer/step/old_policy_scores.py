"""The old-policy (and reference, and teacher) scoring pass of an RL step, on this data-parallel rank's rows, and
on-policy distillation's advantages from the teacher's scores (`algo.distill`; `algorithms.distillation`, eq. 1-2)."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.distillation import mixed_advantages, reverse_kl_advantages
from megatron_rl.config.algo import DistillConfig
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.actor.teacher import FrozenScorer
from megatron_rl.megatron_backend.distributed import sum_over_data_parallel
from megatron_rl.routing.replay import ReplayChecks
from megatron_rl.trainer.step.step_plan import RankBatch


def score_old_and_reference(
    actor: MegatronActor,
    reference: FrozenScorer | None,
    rank: RankBatch,
    replay: ReplayChecks,
    *,
    on_policy: bool = False,
    teacher: FrozenScorer | None = None,
    teacher_top_k: int = 0,
) -> torch.Tensor:
    """Fill `old_log_probs` (with a KL reference `ref_log_probs`; with a distillation `teacher`
    `teacher_log_probs`, and with `teacher_top_k` its top-k `teacher_topk_ids` / `teacher_topk_log_probs`) of
    `rank.batch` (this rank's rows) on the micro-batches of the first update of each mini-batch; the old policy's
    entropy. `on_policy`: the step's first update scores its own mini-batch (`policy_updates.run_updates`), which
    is left at 0 here. With a reference equal to the policy the KL is exactly 0."""
    batch, rows, routes = rank.batch, rank.rows, rank.routes
    skip = rows.plan.updates()[0] if on_policy else None
    batch.fields["old_log_probs"] = torch.zeros_like(batch.fields["loss_mask"])
    entropy = torch.zeros_like(batch.fields["loss_mask"])
    for m in range(len(rows.plan.mini_batches)):
        if m == skip:
            continue
        mb, local = rows.mini_batch(batch, m), rows.local(m)
        if routes is not None and routes.scoring_mode == "replay":
            mb = routes.attach(mb, rows.keys(m))
        mode = routes.scoring_mode if routes is not None else None
        scored = actor.compute_log_probs(mb, with_entropy=True, route_mode=mode, replay=replay)
        batch.fields["old_log_probs"][local] = scored.log_probs
        if scored.entropy is not None:
            entropy[local] = scored.entropy
        if routes is not None:
            routes.after_scoring(rows.keys(m), scored, mb.lengths)
    frozen = {"ref_log_probs": (reference, 0), "teacher_log_probs": (teacher, teacher_top_k)}
    for field, (weights, top_k) in frozen.items():
        if weights is None:
            continue
        batch.fields[field] = torch.zeros_like(batch.fields["loss_mask"])
        if top_k:
            n, s = batch.fields["loss_mask"].shape
            batch.fields["teacher_topk_ids"] = torch.zeros(n, s, top_k, dtype=torch.long)
            batch.fields["teacher_topk_log_probs"] = torch.zeros(n, s, top_k)
        with weights.swapped_in() as frozen_actor:  # routes itself: replay is the trained policy's
            for m in range(len(rows.plan.mini_batches)):
                local = rows.local(m)
                scored = frozen_actor.compute_log_probs(rows.mini_batch(batch, m), top_k=top_k)
                batch.fields[field][local] = scored.log_probs
                if top_k:
                    assert scored.topk_ids is not None and scored.topk_log_probs is not None
                    batch.fields["teacher_topk_ids"][local] = scored.topk_ids
                    batch.fields["teacher_topk_log_probs"][local] = scored.topk_log_probs
    return entropy


def distill_advantages(distill: DistillConfig, batch: TokenBatch) -> dict[str, float]:
    """Collective. Rewrite `batch`'s `advantages` (the task's, per sample) as eq. (2) from its `teacher_log_probs`
    and `old_log_probs`; the step's `distill/teacher_logp_mean` and `distill/reverse_kl` (the mean of
    log π_old − log π_teacher, an estimate of KL(π_old ‖ π_teacher)) over every rank's trained tokens."""
    if "teacher_log_probs" not in batch.fields:  # an engine teacher scores batches as they are collected
        raise RuntimeError(
            f"algo.distill.teacher is set (served_by={distill.served_by}) but this step's samples carry no teacher "
            "log-probs: they were generated before the teacher was configured (an async run's queued batch?); "
            "resume with the configuration that generated them"
        )
    if distill.top_k and "teacher_topk_ids" not in batch.fields:
        raise RuntimeError(
            f"algo.distill.top_k={distill.top_k} but this step's samples carry no teacher top-k log-probs: they "
            "were generated before top_k was configured; resume with the configuration that generated them"
        )
    mask = batch.fields["loss_mask"]
    teacher, old = batch.fields["teacher_log_probs"], batch.fields["old_log_probs"]
    batch.fields["advantages"] = mixed_advantages(
        batch.fields["advantages"],
        reverse_kl_advantages(teacher, old, mask),
        mask,
        coef=distill.coef,
        task_rewards=distill.task_rewards,
    )
    valid = mask > 0
    sums = torch.stack([valid.sum().double(), teacher[valid].double().sum(), (old - teacher)[valid].double().sum()])
    tokens, teacher_sum, kl_sum = sum_over_data_parallel(sums).tolist()
    tokens = max(tokens, 1.0)
    return {"distill/teacher_logp_mean": teacher_sum / tokens, "distill/reverse_kl": kl_sum / tokens}
