"""The critic (`MegatronCritic`, one process, TP=1, fp32) against transformers: its values are the HF backbone's
final hidden states times the head, its update's loss is the float64 clipped value loss of those values, a reward
model's `score.weight` becomes its head, and its updates fit the returns."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.value_loss import clipped_value_loss
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

MICRO_BATCH_TOKENS = 48  # several micro-batches per pass


def _batch() -> TokenBatch:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([20, 13, 17, 9, 20, 15])
    starts = torch.tensor([3, 5, 2, 4, 8, 6])
    ids = torch.randint(4, 100, (6, 20), generator=gen)
    for i in range(6):
        ids[i, lengths[i] :] = 3
    return TokenBatch(ids, lengths, starts)


def _critic(model_dir: Path, lr: float = 1e-3):
    from megatron_rl.config.options import OptimizerOptions
    from megatron_rl.megatron_backend.critic.value_model import MegatronCritic
    from megatron_rl.parallel_layout import ParallelLayout

    return MegatronCritic.from_hf(
        model_dir, ParallelLayout(), micro_batch_tokens=MICRO_BATCH_TOKENS,
        optimizer_options=OptimizerOptions(lr=lr, clip_grad=0.0, distributed_optimizer=False),
    )  # fmt: skip


def _hf_values(model_dir: Path, head: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """Values in the critic's layout (float64 head product of fp32 hidden states): position t = w · h_{t-1}, h the
    final-norm hidden state."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    for i in range(batch.size):
        n = int(batch.lengths[i])
        with torch.no_grad():
            hidden = model.model(batch.input_ids[i : i + 1, :n]).last_hidden_state[0]
        out[i, 1:n] = (hidden.double() @ head.double().T)[: n - 1, 0]
    return out


def _head(critic) -> torch.Tensor:
    return critic.modules[-1].output_layer.weight.detach().clone()


@pytest.mark.usefixtures("megatron_world")
def test_values_equal_transformers_hidden_states_times_the_head(tiny_moe_dir: Path) -> None:
    critic = _critic(tiny_moe_dir)
    batch = _batch()
    values = critic.compute_values(batch)
    head = _head(critic)
    assert head.norm() > 0 and torch.equal(head, _head(_critic(tiny_moe_dir)))  # the fresh head: a fixed draw
    want = _hf_values(tiny_moe_dir, head, batch)
    assert float((values.double() - want).abs().max()) < 1e-5
    assert float(want.abs().max()) > 1e-2  # the values are not all ~0
    padding = torch.arange(20)[None, :] >= batch.lengths[:, None]
    assert not values[padding].any() and not values[:, 0].any()


@pytest.mark.usefixtures("megatron_world")
def test_update_loss_is_the_clipped_value_loss_and_updates_fit_the_returns(tiny_moe_dir: Path) -> None:
    critic = _critic(tiny_moe_dir, lr=3e-3)
    batch = _batch()
    mask = batch.response_mask()
    mask[3] = False  # a sample excluded from the loss
    old = critic.compute_values(batch)
    returns = torch.where(mask, torch.linspace(-1, 1, 20).expand(6, 20), 0.0)
    batch.fields.update(loss_mask=mask.float(), old_values=old, returns=returns)

    def loss_fn(values, _entropy, mb):
        m = mb.fields["loss_mask"]
        loss_sum, metrics = clipped_value_loss(values, mb.fields["old_values"], mb.fields["returns"], m, value_clip=0.2)
        count = (m > 0).sum()
        return loss_sum, count, {"clip_frac": metrics["clip_frac_sum"] / count.clamp(min=1)}

    first = critic.train_step(batch, loss_fn)
    want, _ = clipped_value_loss(_hf_values(tiny_moe_dir, _head(_critic(tiny_moe_dir)), batch), old.double(),
                                 returns.double(), mask, value_clip=0.2)  # fmt: skip
    assert first["count"] == int(mask.sum())
    assert first["loss"] == pytest.approx(float(want) / int(mask.sum()), rel=1e-6)
    assert first["clip_frac"] == 0.0 and first["grad_norm"] > 0
    losses = [first["loss"]]
    for _ in range(15):
        batch.fields["old_values"] = critic.compute_values(batch)
        losses.append(critic.train_step(batch, loss_fn)["loss"])
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.usefixtures("megatron_world")
def test_reward_model_score_head_loads(tiny_moe_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from megatron_rl.models.family import WeightMismatchError

    reward_model = tmp_path / "reward_model"
    shutil.copytree(tiny_moe_dir, reward_model)
    tensors = load_file(reward_model / "model.safetensors")
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    score = torch.linspace(-0.5, 0.5, hidden).unsqueeze(0)
    save_file({**tensors, "score.weight": score}, reward_model / "model.safetensors", metadata={"format": "pt"})
    critic = _critic(reward_model)
    assert torch.equal(_head(critic), score)
    values = critic.compute_values(_batch())
    assert float((values.double() - _hf_values(reward_model, score, _batch())).abs().max()) < 1e-5

    save_file({**tensors, "score.weight": torch.zeros(2, hidden)}, reward_model / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(WeightMismatchError, match=r"num_labels=1"):
        _critic(reward_model)
