"""The trainer's RL loss (`build_rl_loss`) over several micro-batches against the float64 hand computation of
`rl_loss_by_hand` (loss, normaliser, analytic gradient), for every aggregation mode with KL, entropy bonus and
TIS on. The actor sums each micro-batch's `loss_sum` and `count` and divides once (actor.py's loss contract);
this does the same. Everything runs in float64, so the agreement is to rounding (1e-12).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import AGGREGATIONS
from megatron_rl.config.algo import AlgoConfig
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.trainer.step.rl_loss import build_rl_loss
from tests.trainer.rl_loss_by_hand import PRESET_OF, hand_step, rl_algo

# Rows per micro-batch: the last two get a dummy padding row, as the actor's fixed-shape micro-batches do.
GROUPS = [[0, 1, 2], [3, 4], [5, 6]]


def global_batch() -> TokenBatch:
    """7 right-padded samples with 58 response tokens; sample 4 is excluded from the loss (all-zero loss mask).

    Besides the trainer's fields it carries the policy's `log_probs` and `entropy`, so that `select` cuts
    them into micro-batches exactly like the other fields."""
    gen = torch.Generator().manual_seed(11)
    b, s = 7, 20
    lengths = torch.tensor([20, 14, 9, 17, 12, 20, 6])
    starts = torch.tensor([4, 2, 5, 9, 3, 6, 2])
    pos = torch.arange(s)
    mask = (pos >= starts[:, None]) & (pos < lengths[:, None])
    mask[4] = False

    def randn(scale: float) -> torch.Tensor:
        return scale * torch.randn(b, s, generator=gen, dtype=torch.float64)

    old = -3 * torch.rand(b, s, generator=gen, dtype=torch.float64)
    return TokenBatch(
        input_ids=torch.randint(4, 100, (b, s), generator=gen),
        lengths=lengths,
        response_start=starts,
        fields={
            "loss_mask": mask.double(),
            "old_log_probs": old,
            "advantages": torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, s).contiguous(),
            "rollout_log_probs": old + randn(0.5),
            "ref_log_probs": old + randn(0.3),
            "log_probs": old + randn(0.3),
            "entropy": 2 * torch.rand(b, s, generator=gen, dtype=torch.float64),
        },
    )


def trainer_step(algo: AlgoConfig, batch: TokenBatch):
    """What one training step sees: (Σ loss_sum / Σ count, Σ count, ∂/∂log_probs, ∂/∂entropy) in the
    global batch's layout, plus the gradient that reached the dummy padding rows."""
    loss_fn = build_rl_loss(algo)
    rows = max(len(g) for g in GROUPS)
    total_sum = total_count = 0
    leaves = []
    for group in GROUPS:
        mb = batch.select(group, rows=rows)
        log_probs = mb.fields["log_probs"].clone().requires_grad_()
        entropy = mb.fields["entropy"].clone().requires_grad_()
        loss_sum, count, _ = loss_fn(log_probs, entropy, mb)
        assert count.dtype == torch.int32 and count.dim() == 0
        total_sum, total_count = total_sum + loss_sum, total_count + count
        leaves.append((group, log_probs, entropy))
    loss = total_sum / total_count
    loss.backward()
    grad_lp, grad_ent = torch.zeros_like(batch.fields["log_probs"]), torch.zeros_like(batch.fields["entropy"])
    padding_grad = 0.0
    for group, log_probs, entropy in leaves:
        seq = log_probs.shape[1]
        grad_lp[group, :seq] = log_probs.grad[: len(group)]
        grad_ent[group, :seq] = entropy.grad[: len(group)]
        padding_grad += float(log_probs.grad[len(group) :].abs().sum() + entropy.grad[len(group) :].abs().sum())
    return float(loss.detach()), int(total_count), grad_lp, grad_ent, padding_grad


def test_every_aggregation_mode_has_a_hand_formula() -> None:
    assert set(AGGREGATIONS.names()) == set(PRESET_OF)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", sorted(PRESET_OF))
def test_loss_count_and_gradient_equal_the_hand_computation(agg: str, level: str) -> None:
    batch = global_batch()
    loss, count, grad_lp, grad_ent, padding_grad = trainer_step(rl_algo(agg, level), batch)
    want = hand_step(agg, level, batch.fields, batch.fields["log_probs"], batch.fields["entropy"])

    # The data exercises the branches: truncated and untruncated TIS weights, clipped and unclipped tokens.
    assert 0 < want.truncated < 58 and 0 < want.clipped < 58
    assert count == want.count
    assert loss == pytest.approx(want.loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad_lp, want.grad_log_probs, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_ent, want.grad_entropy, rtol=1e-12, atol=1e-15)
    assert padding_grad == 0.0


def test_counts_per_mode_are_tokens_sequences_or_samples() -> None:
    """The normalisers themselves: 58 response tokens, 6 non-empty responses, 7 real samples (Dr. GRPO counts
    the excluded sample, not the 2 dummy padding rows)."""
    batch = global_batch()
    assert int(batch.fields["loss_mask"].sum()) == 58
    counts = {agg: trainer_step(rl_algo(agg, "token"), batch)[1] for agg in sorted(PRESET_OF)}
    assert counts == {
        "seq-mean-token-mean": 6,
        "seq-mean-token-sum": 6,
        "seq-mean-token-sum-norm": 7,
        "token-mean": 58,
    }
