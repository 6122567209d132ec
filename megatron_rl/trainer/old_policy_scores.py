"""The old-policy (and reference) scoring pass of an RL step, on this data-parallel rank's rows."""

from __future__ import annotations

import torch

from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.actor.reference import ReferenceWeights
from megatron_rl.routing.replay import ReplayChecks
from megatron_rl.trainer.step_plan import RankBatch


def score_old_and_reference(
    actor: MegatronActor,
    reference: ReferenceWeights | None,
    rank: RankBatch,
    replay: ReplayChecks,
    *,
    on_policy: bool = False,
) -> torch.Tensor:
    """Fill `old_log_probs` (and `ref_log_probs` with a KL reference) of `rank.batch` (this rank's rows) on the
    micro-batches of the first update of each mini-batch; the old policy's entropy. `on_policy`: the step's first
    update scores its own mini-batch (`policy_updates.run_updates`), which is left at 0 here. With a reference
    equal to the policy the KL is exactly 0."""
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
    if reference is not None:
        batch.fields["ref_log_probs"] = torch.zeros_like(batch.fields["loss_mask"])
        with reference.swapped_in() as ref_actor:
            for m in range(len(rows.plan.mini_batches)):
                scored = ref_actor.compute_log_probs(rows.mini_batch(batch, m))
                batch.fields["ref_log_probs"][rows.local(m)] = scored.log_probs
    return entropy
