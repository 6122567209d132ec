"""The one-pass THD rotary embedding against Megatron's own per-sample path
(`megatron_backend/layers/packed_rope.py`)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.megatron_backend.layers.packed_rope import one_pass_thd, thd_frequencies


class OneRank:
    """A context-parallel group of one rank (what `parallel_state` hands the THD path without CP)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def packed_row(seed: int, samples: int, heads: int = 4, dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (samples,), generator=g)
    cu = torch.zeros(samples + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    t = torch.randn(int(cu[-1]), heads, dim, generator=g, requires_grad=True)
    return t, cu, int(lengths.max())


def rope_freqs(positions: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]


def test_frequencies_are_each_tokens_position_within_its_sample() -> None:
    _, cu, longest = packed_row(0, samples=7)
    freqs = rope_freqs(longest, 16)
    lengths = (cu[1:] - cu[:-1]).tolist()
    expected = torch.cat([freqs[:n] for n in lengths])
    assert torch.equal(thd_frequencies(cu, freqs, int(cu[-1])), expected)
    whole = rope_freqs(int(cu[-1]), 16)  # frequencies for the whole row: kept as they are (Megatron's case 1)
    assert thd_frequencies(cu, whole, int(cu[-1])) is whole


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("samples", [1, 5, 33])
@pytest.mark.parametrize("rotated, mscale", [(16, 1.0), (8, 0.7)])
def test_one_pass_equals_megatrons_per_sample_path(samples: int, interleaved: bool, rotated: int, mscale) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    original = getattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__", rope_utils._apply_rotary_pos_emb_thd)
    t, cu, longest = packed_row(samples, samples)
    freqs = rope_freqs(longest, rotated)  # fewer rotated features than the head's 16: the rest pass through
    one_pass = one_pass_thd(original)
    for _ in range(2):  # the second call reuses the row's cosines and sines
        ref = original(t, cu, freqs, rotary_interleaved=interleaved, mscale=mscale, cp_group=OneRank())
        got = one_pass(t, cu, freqs, rotary_interleaved=interleaved, mscale=mscale, cp_group=OneRank())
        assert torch.equal(got, ref)  # the same elementwise rotation of the same values
        (grad_ref,) = torch.autograd.grad(ref.square().sum(), t)
        (grad_got,) = torch.autograd.grad(got.square().sum(), t)
        assert torch.equal(grad_got, grad_ref)


def test_a_new_row_or_new_frequencies_are_not_served_the_last_rows_factors() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    original = getattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__", rope_utils._apply_rotary_pos_emb_thd)
    one_pass = one_pass_thd(original)
    t, cu, longest = packed_row(3, 6)
    freqs = rope_freqs(longest, 16)
    one_pass(t, cu, freqs, cp_group=OneRank())
    for cu2, freqs2 in ((cu.clone(), freqs * 2), (cu.flip(0).neg().add(int(cu[-1])).contiguous(), freqs)):
        got = one_pass(t, cu2, freqs2, cp_group=OneRank())
        assert torch.equal(got, original(t, cu2, freqs2, cp_group=OneRank()))
    got = one_pass(t.double(), cu, freqs, cp_group=OneRank())  # another dtype
    assert got.dtype == torch.float64
    assert torch.equal(got, original(t.double(), cu, freqs, cp_group=OneRank()))


def test_context_parallel_and_multi_latent_attention_keep_megatrons_function() -> None:
    calls = []

    def original(t, cu_seqlens, freqs, **kwargs):
        calls.append(cu_seqlens)
        return t

    class TwoRanks(OneRank):
        def size(self) -> int:
            return 2

    t, cu, longest = packed_row(1, 4)
    one_pass_thd(original)(t, cu, rope_freqs(longest, 16), cp_group=TwoRanks())
    one_pass_thd(original)(t, cu, rope_freqs(longest, 16), cp_group=OneRank(), multi_latent_attention=True)
    one_pass_thd(original)(t, cu, rope_freqs(longest, 16), cp_group=OneRank())  # rotated here, not by `original`
    assert len(calls) == 2 and torch.equal(calls[0], cu) and calls[1].tolist() == [0, int(cu[-1])]
