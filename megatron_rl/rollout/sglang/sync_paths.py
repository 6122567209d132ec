"""The weight-sync paths by name (`rollout.weight_sync`): `tensor`, `distributed` or `disk`."""

from __future__ import annotations

from megatron_rl.rollout.sglang.distributed_weight_sync import DistributedWeightSync
from megatron_rl.rollout.sglang.weight_sync import DiskWeightSync, TensorWeightSync, WeightSync


def make_weight_sync(
    path: str, *, tp_size: int = 1, master_address: str = "127.0.0.1", group_timeout_s: float = 120.0
) -> WeightSync:
    """A strategy by name: "tensor", "distributed" or "disk"; `tp_size` = GPUs (TP ranks) per server,
    `master_address` = where the servers reach this process for the distributed broadcast group, which must form
    and finish each collective within `group_timeout_s`."""
    if path == "tensor":
        return TensorWeightSync(tp_size=tp_size)
    if path == "distributed":
        return DistributedWeightSync(master_address=master_address, tp_size=tp_size, group_timeout_s=group_timeout_s)
    if path == "disk":
        return DiskWeightSync()
    raise ValueError(f"unknown weight-sync path {path!r}; expected 'tensor', 'distributed' or 'disk'")
