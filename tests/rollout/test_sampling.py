"""Sampling math: greedy, inverse-CDF draws over the top-k/top-p set, and the untruncated log-prob reported."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engines.sampling import check_sampling_params, sample_tokens

LOGITS = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))


def _draw_counts(params: SamplingParams, n: int = 1000) -> torch.Tensor:
    """Sample with n evenly spaced uniforms: counts are exactly n * (truncated, renormalised) probabilities."""
    uniforms = (torch.arange(n) + 0.5) / n
    tokens, log_probs = sample_tokens(LOGITS.expand(n, -1), params, uniforms)
    expected = torch.log_softmax(LOGITS[0] / params.temperature, -1)[tokens]
    torch.testing.assert_close(log_probs, expected)  # untruncated, temperature-scaled
    return torch.bincount(tokens, minlength=4)


def test_full_distribution():
    assert _draw_counts(SamplingParams(temperature=1.0)).tolist() == [100, 400, 200, 300]


def test_top_k_and_top_p_truncate_and_renormalise():
    assert _draw_counts(SamplingParams(temperature=1.0, top_k=2)).tolist() == [0, 571, 0, 429]  # 0.4/0.7, 0.3/0.7
    # top_p 0.6: 0.4 alone is < 0.6, so 0.3 joins; 0.2 and 0.1 are cut
    assert _draw_counts(SamplingParams(temperature=1.0, top_p=0.6)).tolist() == [0, 571, 0, 429]
    assert _draw_counts(SamplingParams(temperature=1.0, top_p=0.3)).tolist() == [0, 1000, 0, 0]  # first always kept
    assert _draw_counts(SamplingParams(temperature=1.0, top_p=0.8, top_k=1)).tolist() == [0, 1000, 0, 0]


def test_temperature_sharpens():
    counts = _draw_counts(SamplingParams(temperature=0.5))  # p^2 normalised: .01 .16 .04 .09 / .30
    assert counts.tolist() == [33, 533, 134, 300]


def test_greedy_reports_temperature_one_log_prob():
    tokens, log_probs = sample_tokens(LOGITS, SamplingParams(temperature=0.0), None)
    assert tokens.tolist() == [1] and log_probs.item() == pytest.approx(torch.log(torch.tensor(0.4)).item())


@pytest.mark.parametrize(
    "params,match",
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=0), "top_k"),
        (SamplingParams(max_new_tokens=-1), "max_new_tokens"),
    ],
)
def test_rejects_invalid_params(params, match):
    with pytest.raises(ValueError, match=match):
        check_sampling_params(params)
