"""Start and stop torch.distributed plus Megatron's process groups for one layout.

Under torchrun the rendezvous comes from its environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). Without RANK the process runs alone: a world of one on a free
local port, which is how single-process tests and notebooks use Megatron.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from megatron_rl.megatron_backend import platform
from megatron_rl.models.family import ModelDims
from megatron_rl.net import free_port
from megatron_rl.parallel_layout import ParallelLayout, ResolvedLayout

T = TypeVar("T")


def init_distributed(
    layout: ParallelLayout,
    *,
    seed: int,
    dims: ModelDims | None = None,
    timeout: timedelta | None = None,
) -> ResolvedLayout:
    """Bridge the platform, join the process group, validate and build `layout`, seed RNGs.

    Args:
        layout: the parallel layout to build.
        seed: base seed; Megatron derives the per-TP-rank and per-expert-rank seeds from it.
        dims: the model the layout is checked against (`ModelDims.layout_checks`); None checks the world only.
        timeout: collective timeout of the default process group (None: torch's default).

    Returns the layout resolved against the world size. If torch.distributed is already
    initialised (a second layout in the same job, after `ParallelLayout.destroy()`), only
    the Megatron groups are built.
    """
    platform.prepare_megatron_import()
    platform.bridge_cpu()
    if not torch.distributed.is_initialized():
        if "RANK" in os.environ:
            platform.select_local_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(platform.dist_backend(), timeout=timeout)
        else:
            platform.select_local_device(0)
            torch.distributed.init_process_group(
                platform.dist_backend(),
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron's process groups already exist; call ParallelLayout.destroy() first")
    resolved = layout.validate(torch.distributed.get_world_size(), **(dims.layout_checks() if dims else {}))
    layout.initialize()
    model_parallel_cuda_manual_seed(seed)
    return resolved


def shutdown() -> None:
    """Destroy Megatron's process groups and the default process group (if any)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (itself in a world of one)."""
    box = [obj]
    if torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """Collective: `decide()` run on rank 0 only and its result on every rank; a `ValueError` it raises (bad
    input, named with its fix) is raised on every rank alike, so all of them stop with rank 0's message."""
    verdict: tuple[Any, ValueError | None] | None = None
    if torch.distributed.get_rank() == 0:
        try:
            verdict = (decide(), None)
        except ValueError as err:
            verdict = (None, err)
    value, error = broadcast_object(verdict)
    if error is not None:
        raise error
    return value


def scatter_by_data_parallel_rank(per_rank: list[bytes] | None) -> bytes:
    """Rank 0's `per_rank[r]` on every rank of data-parallel rank r: each model-parallel group of ranks gets only
    its own part, not every part (rank 0 -> the first rank of each data-parallel rank's group over its
    data-parallel group, then within the context-parallel group, then within the tensor-and-pipeline group)."""
    from megatron.core import parallel_state as ps

    dist = torch.distributed
    mine: list[Any] = [per_rank[0] if per_rank is not None else None]
    if dist.get_world_size() == 1:
        return mine[0]
    first_of_model = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    if first_of_model and ps.get_context_parallel_rank() == 0 and ps.get_data_parallel_world_size() > 1:
        dist.scatter_object_list(mine, per_rank, src=0, group=ps.get_data_parallel_group())
    if first_of_model and ps.get_context_parallel_world_size() > 1:
        group = ps.get_context_parallel_group()
        dist.broadcast_object_list(mine, src=dist.get_global_rank(group, 0), group=group)
    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_model_parallel_group()
        dist.broadcast_object_list(mine, src=dist.get_global_rank(group, 0), group=group)
    return mine[0]


def sum_over_data_parallel(values: torch.Tensor, *, max_last: int = 0) -> torch.Tensor:
    """`values` (a small host tensor) summed over the data-parallel ranks, except the last `max_last` entries, of
    which the maximum is taken."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() == 1:
        return values
    group = ps.get_data_parallel_group()
    n = values.numel() - max_last
    sums, maxima = values[:n].clone(), values[n:].clone()
    torch.distributed.all_reduce(sums, group=group)
    if max_last:
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=group)
    return torch.cat([sums, maxima])


def data_parallel_rank_and_size() -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size of the current layout."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
