"""Route cache: dtype, footprint arithmetic, SGLang-layout alignment, data-parallel sharding."""

import pytest
import torch

from megatron_rl.routing.cache import RouteCache, routes_dtype


def test_dtype_by_expert_count() -> None:
    assert routes_dtype(128) == torch.uint8
    assert routes_dtype(256) == torch.uint8
    assert routes_dtype(257) == torch.int16
    with pytest.raises(ValueError):
        routes_dtype(40000)


def test_footprint_of_32k_sample_48_layers_top8_128_experts() -> None:
    routes = torch.randint(0, 128, (32767, 48, 8), dtype=torch.int32)  # SGLang's layout and dtype: 48 MiB
    small, large = RouteCache(48, 8, 128), RouteCache(48, 8, 512)
    small.put(0, routes, num_tokens=32768)
    large.put(0, routes, num_tokens=32768)
    assert small.get(0).dtype == torch.uint8 and small.nbytes == 48 * 8 * 32767 == 12_582_528  # ~12.0 MiB
    assert large.get(0).dtype == torch.int16 and large.nbytes == 2 * 12_582_528


def test_cache_checks_alignment_and_pads_batches() -> None:
    cache = RouteCache(moe_layers=2, top_k=2, num_experts=8)
    cache.put("a", torch.tensor([[[1, 2], [3, 4]]] * 4), num_tokens=5)
    with pytest.raises(ValueError, match="expected \\(5, 2, 2\\)"):  # off by one: a row for the last token
        cache.put("b", torch.zeros(6, 2, 2, dtype=torch.int32), num_tokens=6)
    with pytest.raises(ValueError, match="expert ids"):
        cache.put("c", torch.full((2, 2, 2), 8), num_tokens=3)
    assert cache.get("a").dtype == torch.uint8
    assert cache.nbytes == 4 * 2 * 2
    routes = cache.batch_routes(["a"], seq_len=7)
    assert routes.shape == (1, 7, 2, 2)
    assert routes[0, :4].tolist() == [[[1, 2], [3, 4]]] * 4
    assert routes[0, 4:].tolist() == [[[0, 1], [0, 1]]] * 3  # last token and padding: distinct dummies
