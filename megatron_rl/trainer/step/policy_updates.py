"""The mini-batch updates of an RL step, on this data-parallel rank's rows.

The first update runs on the weights that scored the batch (the old policy), so its mini-batch's old log-probs are
its own forward's. `algo.first_update_check` says when the old-policy pass still scores that mini-batch, so that
`actor/ppo_kl_first == 0` checks the scoring forward against the training forward bitwise: in the first RL step of
each start (`first_step`), or in every step (`every_step`). On the other steps the update's forward supplies them
(`MegatronActor.train_step_on_policy`), which spares one scoring forward per step: half the old-policy pass at two
mini-batches per step. verl does the same when a step has one mini-batch (`dp_actor.update_policy`, `on_policy`).
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.megatron_backend.actor.batch import LossFn
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.routing.replay import ReplayChecks
from megatron_rl.routing.step_routes import StepRoutes
from megatron_rl.trainer.step.step_plan import RankBatch


def first_update_scores_itself(
    algo: AlgoConfig, step: int, first_step: int, routes: StepRoutes | None, replay: ReplayChecks
) -> bool:
    """Whether the first update's forward supplies its mini-batch's old log-probs (and entropy) this step, instead
    of the old-policy pass. Never on a checked step (`algo.first_update_check`), under R2 (the old-policy pass
    records the routes every update replays), with distillation (its advantages read the old log-probs before any
    update; so does `algo.kl_in_reward`'s reward) or when this step measures R3's rollout agreement (a scoring
    pass's metric)."""
    if algo.first_update_check == "every_step" or step == first_step or algo.distill.teacher is not None:
        return False  # distillation's advantages need every mini-batch's old log-probs before the first update
    if algo.kl_in_reward:
        return False
    return routes is None or (routes.scoring_mode == "replay" and not replay.agreement)


def run_updates(
    actor: MegatronActor,
    loss_fn: LossFn,
    rank: RankBatch,
    replay: ReplayChecks,
    entropy: torch.Tensor,
    *,
    on_policy: bool,
    step: int,
    on_nonfinite: Literal["stop", "skip"],
    skip_grad_norm_above: float | None,
) -> list[dict[str, float]]:
    """Every update of the step on this rank's rows (`rank.rows.plan.updates()`, epoch after epoch), each one's
    metrics. `on_policy`: the first update also writes its mini-batch's `old_log_probs` into `rank.batch` and its
    entropy into `entropy` (the rows the old-policy pass left out), before any later update reads them.
    `on_nonfinite` and `skip_grad_norm_above` are `train_step`'s."""
    batch, rows, routes = rank.batch, rank.rows, rank.routes
    order = rows.plan.updates()
    updates = []
    for i, m in enumerate(order):
        mb = rows.mini_batch(batch, m)
        mb = routes.attach(mb, rows.keys(m)) if routes is not None else mb
        where = f"step {step}, update {i + 1} of {len(order)}"
        mode: Literal["replay"] | None = "replay" if routes is not None else None
        if i == 0 and on_policy:
            metrics, scored = actor.train_step_on_policy(
                mb, loss_fn, route_mode=mode, replay=replay, where=where, on_nonfinite=on_nonfinite,
                skip_grad_norm_above=skip_grad_norm_above,
            )  # fmt: skip
            local = rows.local(m)
            batch.fields["old_log_probs"][local] = scored.log_probs
            if scored.entropy is not None:
                entropy[local] = scored.entropy
        else:
            metrics = actor.train_step(
                mb, loss_fn, with_entropy=True, route_mode=mode, replay=replay, where=where, on_nonfinite=on_nonfinite,
                skip_grad_norm_above=skip_grad_norm_above,
            )  # fmt: skip
        updates.append(metrics)
    return updates
