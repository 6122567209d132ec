"""The critic's part of an RL step (PPO with a learned critic, `algo.advantage: gae`).

After the old-policy (and reference) scores, `critic_advantages` scores this rank's rows with the critic (the old
values), turns each sample's outcome reward into per-token rewards (at its last generated token; with
`algo.kl_in_reward` minus `kl_coef · (log π_old − log π_ref)` at every generated token), and writes the actor's
per-token `advantages` (GAE with the actor's λ, whitened over every rank's tokens) and the critic's `returns` (GAE
with the critic's λ) into the rank's batch. `critic_updates` then trains the critic on the step's mini-batches,
in the order the actor's updates run, with PPO's clipped value loss. docs/algorithms.md, "PPO with a critic".
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_rl.algorithms.gae import (
    gae,
    last_token_rewards,
    length_adaptive_lambda,
    masked_whiten,
    mean_and_var,
    moment_sums,
)
from megatron_rl.algorithms.value_loss import clipped_value_loss, explained_variance
from megatron_rl.config.algo import AlgoConfig, CriticConfig
from megatron_rl.megatron_backend.actor.batch import LossFn, TokenBatch
from megatron_rl.megatron_backend.critic.value_model import MegatronCritic
from megatron_rl.megatron_backend.distributed import sum_over_data_parallel
from megatron_rl.trainer.step.step_plan import RankBatch


def critic_advantages(critic: MegatronCritic, algo: AlgoConfig, rank: RankBatch) -> dict[str, float]:
    """Collective. Fill `rank.batch`'s `old_values`, `returns` and per-token `advantages`; the step's
    `critic/*` statistics over every rank's trained tokens (values and returns before the critic's update)."""
    batch, rows, options = rank.batch, rank.rows, algo.critic
    mask = batch.fields["loss_mask"] > 0
    values = torch.zeros(mask.shape, dtype=torch.float32)
    for m in range(len(rows.plan.mini_batches)):
        values[rows.local(m)] = critic.compute_values(rows.mini_batch(batch, m)).float()
    rewards = last_token_rewards(rank.rewards.double(), mask)
    if algo.kl_in_reward:
        kl = batch.fields["old_log_probs"].double() - batch.fields["ref_log_probs"].double()
        rewards = rewards - algo.kl_coef * torch.where(mask, kl, 0.0)
    actor_lam = _actor_lambda(options, mask)
    advantages, returns = gae(rewards, values.double(), mask, gamma=options.gamma, lam=actor_lam)
    if not (isinstance(actor_lam, float) and actor_lam == options.lam):
        _, returns = gae(rewards, values.double(), mask, gamma=options.gamma, lam=options.lam)
    sums = torch.cat([moment_sums(x, mask) for x in (advantages, returns, values.double(), returns - values)])
    adv, ret, val, residual = (mean_and_var(s) for s in sum_over_data_parallel(sums).split(3))
    if options.whiten:
        advantages = masked_whiten(advantages, mask, mean=adv[0], var=adv[1])
    batch.fields.update(advantages=advantages.float(), returns=returns.float(), old_values=values)
    return {
        "critic/values_mean": val[0],
        "critic/returns_mean": ret[0],
        "critic/advantages_mean": adv[0],  # before whitening
        "critic/advantages_std": adv[1] ** 0.5,
        "critic/explained_variance": explained_variance(residual[1], ret[1]),
    }


def _actor_lambda(options: CriticConfig, mask: torch.Tensor) -> float | torch.Tensor:
    """The actor's GAE λ: per row with VAPO's length-adaptive λ (`lam_actor_alpha`), else `lam_actor` or `lam`."""
    if options.lam_actor_alpha > 0:
        return length_adaptive_lambda(mask.sum(-1), options.lam_actor_alpha)
    return float(options.lam if options.lam_actor is None else options.lam_actor)


def build_value_loss(value_clip: float | None) -> LossFn:
    """The critic's loss contract (`batch.LossFn`): PPO's clipped value loss summed over the micro-batch's valid
    tokens with their count, so Megatron's per-token mode gives the global token mean; `clip_frac` per token."""

    def loss_fn(values: torch.Tensor, _entropy: torch.Tensor | None, mb: TokenBatch):
        device = values.device
        mask = mb.fields["loss_mask"].to(device)
        old, returns = mb.fields["old_values"].to(device), mb.fields["returns"].to(device)
        loss_sum, metrics = clipped_value_loss(values, old, returns, mask, value_clip=value_clip)
        count = (mask > 0).sum()
        return loss_sum, count.to(torch.int), {"clip_frac": metrics["clip_frac_sum"] / count.clamp(min=1)}

    return loss_fn


def critic_updates(
    critic: MegatronCritic,
    loss_fn: LossFn,
    rank: RankBatch,
    *,
    step: int | str,
    on_nonfinite: Literal["stop", "skip"],
) -> dict[str, float]:
    """Collective. The critic's updates of the step on this rank's rows (`rank.rows.plan.updates()`, the actor's
    order) and their mean `critic/vf_loss`, `critic/vf_clip_frac`, `critic/grad_norm`, `critic/lr`."""
    rows, order = rank.rows, rank.rows.plan.updates()
    updates = []
    for i, m in enumerate(order):
        where = f"step {step}, critic update {i + 1} of {len(order)}"
        updates.append(critic.train_step(rows.mini_batch(rank.batch, m), loss_fn, on_nonfinite=on_nonfinite,
                                         where=where))  # fmt: skip
    names = {"loss": "vf_loss", "clip_frac": "vf_clip_frac", "grad_norm": "grad_norm", "lr": "lr"}
    return {f"critic/{name}": sum(u.get(key, 0.0) for u in updates) / len(updates) for key, name in names.items()}
