"""`Packing`: where samples lie in a packed row, by hand."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.megatron_backend.actor.packing import Packing


def test_pack_and_unpack_by_hand() -> None:
    packing = Packing.of([3, 1, 2], multiple=4)  # 6 tokens, padded to 8
    assert packing.total == 8 and packing.used == 6
    assert packing.segments() == [3, 1, 2, 2]
    assert packing.cu_seqlens().tolist() == [0, 3, 4, 6, 8]
    assert packing.positions().tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    per_sample = torch.arange(12).view(3, 4)
    packed = packing.pack(per_sample, fill=-1)
    assert packed.tolist() == [[0, 1, 2, 4, 8, 9, -1, -1]]
    assert packing.unpack(packed, 4).tolist() == [[0, 1, 2, 0], [4, 0, 0, 0], [8, 9, 0, 0]]
    # Trailing dimensions (routes: [n, s, layers, k]) travel along.
    routes = torch.arange(3 * 4 * 2).view(3, 4, 2)
    assert torch.equal(packing.unpack(packing.pack(routes), 4)[0, :3], routes[0, :3])


def test_no_padding_without_a_multiple_and_a_fixed_total() -> None:
    assert Packing.of([5, 7]).segments() == [5, 7]
    assert Packing.of([5, 7], total=16).segments() == [5, 7, 4]
    with pytest.raises(ValueError, match="not a multiple of 4"):
        Packing.of([5, 7], multiple=4, total=14)
    with pytest.raises(ValueError, match="do not fit"):
        Packing.of([5, 7], total=10)
    with pytest.raises(ValueError, match="at least one token"):
        Packing.of([5, 0])
    with pytest.raises(ValueError, match="does not fit the per-sample width"):
        Packing.of([5]).unpack(torch.zeros(1, 5), 4)


def test_unpack_passes_gradients_to_the_samples_tokens_only() -> None:
    packing = Packing.of([2, 3], total=6)
    packed = torch.zeros(1, 6, requires_grad=True)
    packing.unpack(packed, 3).sum().backward()
    assert packed.grad.tolist() == [[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]  # the trailing padding gets none
