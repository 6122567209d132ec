"""The host snapshot of a background checkpoint save (`background_writer.HostSnapshot`)."""

from __future__ import annotations

import torch

from megatron_rl.megatron_backend import platform


def test_snapshot_is_the_state_at_the_save_and_reuses_its_buffers() -> None:
    """Tensors (sharded, in a factory, plain) are copied into host buffers: changing the originals in place after
    the snapshot does not change it; the next snapshot of a state of the same structure writes into the same
    buffers; objects are deep copies; non-persistent objects are left as they are."""
    platform.bridge_cpu()
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor

    from megatron_rl.megatron_backend.checkpoint.background_writer import HostSnapshot

    weight, moment, scalar = torch.arange(6.0).reshape(2, 3), torch.ones(4), torch.tensor(3.0)
    groups = [{"lr": 0.1, "betas": (0.9, 0.95)}]
    step = torch.tensor(7.0)

    def state() -> dict:
        return {
            "model": {"w": ShardedTensor.from_rank_offsets("w", weight)},
            "optimizer": {
                "groups": ShardedObject("groups", groups, (1,), (0,)),
                "state": [ShardedTensor.from_rank_offsets("m", moment[1:])],  # a view
                "step": LocalNonpersistentObject(step),
            },
            "scalar": scalar,
        }

    snapshot = HostSnapshot()
    first = snapshot.take(state())
    snapshot.wait_copied()
    buffers = [first["model"]["w"].data, first["optimizer"]["state"][0].data, first["scalar"]]
    weight.add_(100.0)
    moment.mul_(-2.0)
    scalar.fill_(-1.0)
    groups[0]["lr"] = 0.5
    assert torch.equal(first["model"]["w"].data, torch.arange(6.0).reshape(2, 3))
    assert torch.equal(first["optimizer"]["state"][0].data, torch.ones(3))
    assert first["scalar"].item() == 3.0
    assert first["optimizer"]["groups"].data == [{"lr": 0.1, "betas": (0.9, 0.95)}]
    assert first["optimizer"]["step"].unwrap() is step
    assert all(b.data_ptr() != s.data_ptr() for b, s in zip(buffers, (weight, moment, scalar), strict=True))

    second = snapshot.take(state())
    again = [second["model"]["w"].data, second["optimizer"]["state"][0].data, second["scalar"]]
    assert all(a is b for a, b in zip(again, buffers, strict=True))  # the same buffers, overwritten
    assert torch.equal(first["model"]["w"].data, torch.arange(6.0).reshape(2, 3) + 100.0)
    assert torch.equal(second["optimizer"]["state"][0].data, torch.full((3,), -2.0))
    assert second["optimizer"]["groups"].data[0]["lr"] == 0.5
