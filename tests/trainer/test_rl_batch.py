"""`samples_to_batch`: the loss mask of a multi-turn sample trains exactly its generated tokens."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.sample import Sample
from megatron_rl.trainer.step.rl_batch import samples_to_batch


def test_a_samples_loss_mask_reaches_the_batch() -> None:
    # Prompt [5, 6]; response: 2 generated tokens, 2 observation tokens, 1 generated token.
    turns = Sample([5, 6], [7, 8, 9, 10, 11], [-0.1, -0.2, 0.0, 0.0, -0.3], "stop", "v1", loss_mask=[1, 1, 0, 0, 1])
    plain = Sample([5], [7, 8], [-0.5, -0.6], "stop", "v1")
    batch = samples_to_batch([turns, plain], advantages=torch.tensor([1.0, -1.0]))
    assert batch.fields["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0]]
    assert batch.fields["rollout_log_probs"][0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3])


def test_a_loss_mask_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="2 loss-mask entries for 3 response tokens"):
        Sample([5], [7, 8, 9], [0.0, 0.0, 0.0], "stop", "v1", loss_mask=[1, 0])
