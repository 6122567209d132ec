"""The metrics one RL step reports: rollout, trainer-vs-engine mismatch, the updates' means and the phases' times
(`StepClock`). Pure functions of their inputs, except `scoring_metrics`, which sums this rank's share over the
data-parallel ranks (collective)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl.algorithms import kl_penalty
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.distributed import sum_over_data_parallel
from megatron_rl.rollout.agent.multi_turn import multi_turn_metrics

if TYPE_CHECKING:
    from megatron_rl.trainer.step.step_plan import RankBatch


def rollout_metrics(rollout: Any) -> dict[str, float]:
    """Rollout metrics; reward and accuracy are over every scored sample (dynamic sampling keeps a biased
    subset), lengths over the kept ones."""
    samples = rollout.samples
    groups = rollout.kept_groups + rollout.dropped_groups + rollout.aborted_groups
    metrics = {
        "rollout/reward_mean": float(rollout.reward_stats.mean),
        "rollout/filtered_group_frac": rollout.dropped_groups / max(groups, 1),
        "rollout/tries": float(rollout.tries),
        "rollout/batch_filled": float(rollout.filled),
        "rollout/reward_errors": float(rollout.reward_stats.errors + rollout.reward_stats.timeouts),
        "rollout/samples": float(len(samples)),
        **rollout.reward_stats.metrics(),  # reward/<name>_mean and _errors per named reward, reward/failure_limit
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
        if any("turns" in s.metadata for s in samples):
            metrics.update(multi_turn_metrics(samples))
    return metrics


def mismatch_sums(batch: TokenBatch, old_log_probs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """Trainer vs rollout-engine log-probs of `batch`'s trained tokens (multi-turn observations have no engine
    log-prob), as float64 sums that add over data-parallel shards: `[tokens, sum |diff|, sum k3 KL, sum entropy,
    max |diff|]` (the last is a maximum; `mismatch_metrics` reads them)."""
    mask = batch.response_mask() & (batch.fields["loss_mask"] > 0)
    trainer, engine = old_log_probs[mask].double(), batch.fields["rollout_log_probs"][mask].double()
    diff = (trainer - engine).abs()
    return torch.stack(
        [
            mask.sum().double(),
            diff.sum(),
            kl_penalty(engine, trainer, "k3").sum(),
            entropy[mask].double().sum(),
            diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64),
        ]
    )


def mismatch_metrics(sums: torch.Tensor) -> dict[str, float]:
    """Mean |diff|, max |diff|, mean k3 KL and the old policy's mean entropy from `mismatch_sums` (summed over
    the data-parallel ranks, the maximum taken)."""
    tokens, abs_diff, k3, entropy, largest = sums.tolist()
    if not tokens:
        return {}
    return {
        "mismatch/logp_abs_diff": abs_diff / tokens,
        "mismatch/logp_abs_diff_max": largest,
        "mismatch/k3_kl": k3 / tokens,
        "actor/entropy_old": entropy / tokens,
    }


def scoring_metrics(batch: TokenBatch, entropy: torch.Tensor, *, received_bytes: int) -> dict[str, float]:
    """Collective. The mismatch metrics of the whole step from this rank's rows (`batch`, scored), and what the
    data path moved: `data/rows` (this rank's rows), `data/bytes_received_max` (over the data-parallel ranks)."""
    sums = mismatch_sums(batch, batch.fields["old_log_probs"], entropy)
    received = torch.tensor([float(received_bytes)], dtype=torch.float64)
    reduced = sum_over_data_parallel(torch.cat([sums, received]), max_last=2)
    return {
        **mismatch_metrics(reduced[:-1]),
        "data/rows": float(batch.size),
        "data/bytes_received_max": float(reduced[-1]),
    }


def update_metrics(updates: list[dict[str, float]]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """`(metrics, routing)`: the mean of the updates' metrics as `actor/*` (the loss's `distill/*` as they are),
    with the first update's `ppo_kl`
    (exactly 0 on-policy), the last update's grad norm and LR and the largest finite grad norm of them all
    (`actor/grad_norm_max`, what `trainer.stop_on` reads), and each update's `routing/*` entries apart. Updates
    skipped for a NaN/inf (`trainer.on_nonfinite=skip`) or a grad norm above `trainer.stop_on`'s skip threshold
    are counted, not averaged."""
    norms = [u["grad_norm"] for u in updates if math.isfinite(u["grad_norm"])]
    nonfinite = [bool(u.pop("nonfinite_skipped", 0.0)) for u in updates]
    too_large = [bool(u.pop("grad_norm_skipped", 0.0)) for u in updates]
    applied = [u for u, a, b in zip(updates, nonfinite, too_large, strict=True) if not (a or b)]
    metrics = {
        "actor/nonfinite_skipped": float(sum(nonfinite)),
        "actor/grad_norm_skipped": float(sum(too_large)),
        "actor/grad_norm_max": max(norms, default=float("nan")),
    }
    updates = applied or updates
    routing = [{k: u.pop(k) for k in list(u) if k.startswith("routing/")} for u in updates]
    keys = set().union(*updates)
    for k in keys:
        name = k if k.startswith(("actor/", "distill/")) else f"actor/{k}"
        metrics[name] = sum(u.get(k, 0.0) for u in updates) / len(updates)
    metrics["actor/ppo_kl_first"] = updates[0].get("actor/ppo_kl", 0.0)
    metrics["actor/grad_norm"] = updates[-1]["grad_norm"]
    metrics["actor/lr"] = updates[-1]["lr"]
    return metrics, routing


def training_metrics(
    rank: RankBatch, entropy: torch.Tensor, updates: list[dict[str, float]], *, on_policy: bool
) -> dict[str, float]:
    """Collective. The step's scoring metrics from this rank's scored rows (`scoring_metrics`), its updates'
    (`update_metrics`), the routes' with routing replay, and `actor/ppo_kl_first_checked`: 1 when the old-policy
    pass scored the first update's mini-batch, so that `actor/ppo_kl_first` compared scoring with training."""
    metrics = scoring_metrics(rank.batch, entropy, received_bytes=rank.received_bytes)
    metrics["actor/ppo_kl_first_checked"] = float(not on_policy)
    means, routing = update_metrics(updates)
    metrics.update(means)
    if rank.routes is not None:
        metrics.update(rank.routes.metrics(routing))
    return metrics


class StepClock:
    """A step's phase times: `with clock("time/<phase>"):` times one phase; `metrics()` gives them with
    `time/step`, the time since the clock was made."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, key: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[key] = time.perf_counter() - t

    def metrics(self) -> dict[str, float]:
        return {**self.times, "time/step": time.perf_counter() - self.start}
