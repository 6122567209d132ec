"""What one training update's micro-batch outputs say: non-finite losses/gradients, and the reduced metrics.

Each micro-batch output (last pipeline stage) is `{"loss_sum": tensor, "metrics": {name: float, "_count": int}}`.
The non-finite check costs no pass and no collective of its own: the loss is in the metric sums every rank
reduces anyway, and a NaN/inf gradient makes the optimizer's global gradient norm NaN/inf.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.micro_batches import is_last_stage

logger = logging.getLogger(__name__)


class NonFiniteError(ValueError):
    """A training update's loss or gradient is NaN/inf; the update was not applied. A ValueError like the
    project's other input errors (the CLI prints its one line): the cause is an input of the run (learning
    rate, rewards, data), not the code."""


def nonfinite_problem(
    totals: dict[str, float], grad_norm: float, outputs: list, chunks: list[Any], count: int, where: str
) -> str | None:
    """Why this update must not be applied, else None: read from what every rank already agrees on, the loss
    summed over micro-batches, stages and DP ranks (`reduce_metric_sums`) and the optimizer's global gradient
    norm (NaN/inf when any gradient it covers is). Only when one of them is not finite does this run the
    collective diagnosis `find_nonfinite` (every rank takes the same branch: both values are the same on every
    rank), which names the micro-batch, or finds every gradient finite (a norm that overflowed: applied, as
    the optimizer clips it)."""
    if math.isfinite(totals["loss"]) and math.isfinite(float(grad_norm)):
        return None
    return find_nonfinite(outputs, chunks, count, where)


def drop_nonfinite_update(problem: str, chunks: list[Any], optimizer: Any, on: Literal["stop", "skip"]) -> None:
    """Drop the gradients of an update `nonfinite_problem` refused, then raise `NonFiniteError` (`on="stop"`)
    or warn (`on="skip"`: the caller skips the optimizer step)."""
    drop_gradients(chunks, optimizer)
    if on == "stop":
        raise NonFiniteError(
            f"{problem}; the update was not applied (lower optimizer.lr or check the rewards; "
            "trainer.on_nonfinite=skip skips such updates)"
        )
    if dist.get_rank() == 0:
        logger.warning("%s; update skipped (trainer.on_nonfinite=skip)", problem)


def grad_norm_too_large(grad_norm: float, limit: float | None, where: str) -> bool:
    """Whether an update's (finite) global grad norm is above `trainer.stop_on`'s skip `limit`: its gradients are
    to be dropped (`drop_gradients`) and the optimizer step skipped; warns on rank 0. The norm is the same on every
    rank, so every rank skips alike."""
    if limit is None or not float(grad_norm) > limit:
        return False
    if dist.get_rank() == 0:
        logger.warning(
            "grad norm %.4g at %s is above trainer.stop_on['actor/grad_norm'] threshold %g; update skipped",
            float(grad_norm),
            where,
            limit,
        )
    return True


def drop_gradients(chunks: list[Any], optimizer: Any) -> None:
    """Zero this update's gradients (DDP's buffers and the optimizer's): the optimizer step is not taken."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def find_nonfinite(outputs: list, chunks: list[Any], count: int, where: str) -> str | None:
    """Collective: why this update must not be applied (a NaN/inf micro-batch loss or gradient on any rank),
    else None. The gradient check reads DDP's reduced grad buckets, before the optimizer clips them (clipping
    by a NaN norm would spread the NaN to every weight). A full pass over every bucket: `nonfinite_problem`
    calls it only for an update already known to be non-finite."""
    bad_micro_batch, detail = 0, ""
    for i, out in enumerate(outputs if is_last_stage() else [], start=1):
        loss = float(out["loss_sum"])
        if not math.isfinite(loss):
            values = {"loss_sum": loss, **{k: v for k, v in out["metrics"].items() if k != "_count"}}
            detail = ", ".join(f"{k}={v:g}" for k, v in values.items() if not math.isfinite(v))
            bad_micro_batch = i
            break
    bad_grads = torch.zeros((), device=platform.device())
    for chunk in chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            for bucket in buffer.buckets:  # bucket by bucket: the bool temporary stays small
                bad_grads = bad_grads.logical_or(~torch.isfinite(bucket.grad_data).all())
    flags = torch.stack([torch.tensor(float(bad_micro_batch), device=bad_grads.device), bad_grads.float()])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    micro_batch, grads = int(flags[0]), bool(flags[1])
    if micro_batch:
        shown = f" ({detail})" if micro_batch == bad_micro_batch else " (on another rank)"
        return f"non-finite loss at {where}, micro-batch {micro_batch} of {count}{shown}"
    if grads:
        return f"non-finite gradient at {where} (every micro-batch loss is finite)"
    return None


def reduce_metric_sums(outputs: list, groups: dict) -> dict[str, float]:
    """Collective: the loss and the loss function's count-weighted metrics summed over micro-batches, pipeline
    stages and DP ranks (`count`: the normaliser's total), the same on every rank."""
    from megatron.core import parallel_state as ps

    sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
    for out in outputs if is_last_stage() else []:
        m = out["metrics"]
        sums["loss"] += float(out["loss_sum"])
        sums["count"] += m["_count"]
        for key, value in m.items():
            if key != "_count":
                sums[key] = sums.get(key, 0.0) + value * m["_count"]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [sums]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=groups["pp"])
        sums = box[0]
    names = sorted(sums)
    vec = torch.tensor([sums[n] for n in names], dtype=torch.float64, device=platform.device())
    dist.all_reduce(vec, group=groups["dp"])
    return dict(zip(names, vec.tolist(), strict=True))


def mean_metrics(
    totals: dict[str, float], grad_norm: float | None, optimizer: Any, *, lr: float | None = None
) -> dict[str, float]:
    """Count-weighted means of `reduce_metric_sums`' totals, the grad norm and the learning rate (`lr`, else the
    optimizer's current one)."""
    count = max(totals["count"], 1.0)
    metrics = {n: v / count for n, v in totals.items() if n != "count"}
    metrics["count"] = totals["count"]
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["lr"] = float(optimizer.param_groups[0]["lr"]) if lr is None else lr
    return metrics
