"""Which rows of a step's batch each data-parallel rank trains on: computed once per step, the same on every rank.

A step's batch is split into `algo.mini_batches_per_step` mini-batches by a seeded shuffle; each mini-batch is
split over the data-parallel ranks by the token-balanced partition of its rows' lengths
(`balance.balanced_partition`, the rule `micro_batches.data_parallel_partition` applies to a whole batch). The
plan is fixed for the step: scoring, routing replay and every update of every epoch use it, so a rank needs, is
sent and keeps only its own rows (`share_rows`). Later epochs run the same mini-batches in a seeded order (verl
keeps each rank's rows across epochs the same way). `rank_batch` gives a rank all it trains on in one step: its
rows, their batch and their recorded routes.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.megatron_backend.actor.balance import balanced_partition, imbalance
from megatron_rl.megatron_backend.actor.batch import DPShare, TokenBatch
from megatron_rl.megatron_backend.distributed import data_parallel_rank_and_size, scatter_by_data_parallel_rank
from megatron_rl.models.family import ModelDims
from megatron_rl.rollout.sample import Sample
from megatron_rl.routing.replay import ReplayMode
from megatron_rl.routing.step_routes import StepRoutes
from megatron_rl.trainer.step.rl_batch import samples_to_batch, select


@dataclass(frozen=True)
class StepPlan:
    """`mini_batches[m]`: the rows of mini-batch m (ascending); `shares[m][r]`: the rows of it that data-parallel
    rank r feeds, in the order it feeds them; `imbalance[m]`: max / mean tokens per rank of mini-batch m;
    `epochs[e]`: the order in which epoch e runs the mini-batches."""

    mini_batches: list[list[int]]
    shares: list[list[list[int]]]
    imbalance: list[float]
    epochs: list[list[int]]

    def rows_of(self, dp_rank: int) -> list[int]:
        """Every row data-parallel rank `dp_rank` feeds this step (ascending)."""
        return sorted(i for share in self.shares for i in share[dp_rank])

    def updates(self) -> list[int]:
        """The mini-batch of each update, in the order the step runs them (epoch after epoch)."""
        return [m for order in self.epochs for m in order]


def plan_step(
    lengths: list[int],
    *,
    mini_batches: int,
    epochs: int,
    dp: int,
    seed: int,
    step: int,
    quadratic: float = 0.0,
) -> StepPlan:
    """The plan of a step whose samples have `lengths` (a sample costs `length + quadratic * length^2` when
    balancing); the shuffles are seeded by (`seed`, `step`), so every rank computes the same plan."""
    shuffle = torch.Generator().manual_seed(seed * 1_000_003 + step * 1000)
    order = torch.randperm(len(lengths), generator=shuffle)
    parts = [sorted(part.tolist()) for part in order.chunk(mini_batches)]
    shares, balance = [], []
    for part in parts:
        if len(part) < dp:
            raise ValueError(
                f"a mini-batch of {len(part)} samples is smaller than the data-parallel size {dp}: raise "
                "rollout.prompts_per_step or lower algo.mini_batches_per_step"
            )
        part_lengths = [lengths[i] for i in part]
        split = balanced_partition(part_lengths, dp, alpha=quadratic) if dp > 1 else [list(range(len(part)))]
        shares.append([[part[j] for j in rows] for rows in split])
        balance.append(imbalance(part_lengths, split))
    runs = [list(range(len(parts)))]
    for epoch in range(1, epochs):
        reorder = torch.Generator().manual_seed(seed * 1_000_003 + step * 1000 + epoch)
        runs.append(torch.randperm(len(parts), generator=reorder).tolist())
    return StepPlan(parts, shares, balance, runs)


class RankRows:
    """One data-parallel rank's part of a `StepPlan`: its rows (`rows`, ascending: the order of the batch built
    from its samples) and each mini-batch's share of them."""

    def __init__(self, plan: StepPlan, dp_rank: int):
        self.plan, self.dp_rank = plan, dp_rank
        self.rows = plan.rows_of(dp_rank)
        self._position = {row: j for j, row in enumerate(self.rows)}

    def keys(self, m: int) -> list[int]:
        """Mini-batch `m`'s rows this rank feeds, as rows of the step's batch, in the order it feeds them."""
        return self.plan.shares[m][self.dp_rank]

    def local(self, m: int) -> list[int]:
        """The same rows as positions in this rank's batch."""
        return [self._position[row] for row in self.keys(m)]

    def mini_batch(self, batch: TokenBatch, m: int) -> TokenBatch:
        """This rank's share of mini-batch `m` from its `batch`, marked as such for the actor (`DPShare`)."""
        mb = select(batch, self.local(m))
        mb.dp_share = DPShare(self.plan.imbalance[m])
        return mb


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


@dataclass(frozen=True)
class RankBatch:
    """What this data-parallel rank trains on in one step: its `rows` of the step's plan, their `batch` (with
    advantages), their recorded routes (`routes`, with routing replay), the bytes it received for them and their
    outcome `rewards` (`[rows]`; a critic's GAE spreads them over tokens)."""

    rows: RankRows
    batch: TokenBatch
    routes: StepRoutes | None
    received_bytes: int
    rewards: torch.Tensor


def rank_batch(cfg: Any, step: int, rollout: Any, advantages: torch.Tensor, dims: ModelDims) -> RankBatch:
    """Collective. Step `step`'s plan (`plan_step` of the rollout's sample lengths under `cfg.algo`'s mini-batches
    and epochs, seeded by `cfg.trainer.seed`), and this rank's rows of it: sent by rank 0, which holds every
    sample (`rollout.samples`, a `rollout_phase.StepRollout`), with their `advantages` (every sample's) and, under
    `cfg.algo.routing_replay`, their routes."""
    algo = cfg.algo
    dp_rank, dp = data_parallel_rank_and_size()
    plan = plan_step(
        rollout.lengths, mini_batches=algo.mini_batches_per_step, epochs=algo.ppo_epochs, dp=dp,
        seed=cfg.trainer.seed, step=step, quadratic=cfg.trainer.balance_quadratic,
    )  # fmt: skip
    rows = RankRows(plan, dp_rank)
    mine, received = share_rows(rollout.samples, plan)
    mode = ReplayMode(algo.routing_replay)
    routes = StepRoutes(mode, dims, rows.rows) if mode.on else None
    if routes is not None:
        routes.put_rollout(dict(zip(rows.rows, mine, strict=True)))
    rewards = torch.tensor(rollout.rewards, dtype=torch.float32)[rows.rows]
    return RankBatch(rows, samples_to_batch(mine, advantages=advantages[rows.rows]), routes, received, rewards)
