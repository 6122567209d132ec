"""The update's non-finite check read from the gradient norm and the metric sums, and its clipped step.

A real actor (one process, gloo, the distributed optimizer, clip 1.0, fp32) on the tiny Qwen3-MoE:
* the update `train_step` applies equals, bit for bit, the one Megatron's own `optimizer.step()` applies
  after the former full pass over the gradient buckets (`find_nonfinite`), with the same grad norm;
* torch's fused Adam (now used where the device has it) moves the weights as the per-tensor Adam Megatron
  built before, to float32 rounding;
* a NaN gradient with every loss finite stops the update (`on_nonfinite="stop"`) with its message, or is
  skipped with the weights, Adam's state and the step count untouched; a NaN loss names its micro-batch.
Two data-parallel ranks, a NaN gradient on one of them only: `test_nan_gradient_on_one_rank_is_detected`.
The CPU bridge of the one-rank in-place buffer collectives: `test_one_rank_buffer_collectives_are_the_identity`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.megatron_backend.actor.batch import TokenBatch
from tests.dist_harness import run_torchrun
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

SCRIPT = Path(__file__).parent / "scripts" / "nonfinite_rank_check.py"
# Fused and per-tensor Adam round differently: from the same gradients, after a step of 1e-2, a weight differs
# by at most a few ulps of its tensor's largest weight (measured: up to 1, 1.2e-7 near 1.0, on this AMD EPYC).
ADAM_ULPS = 4


def batch() -> TokenBatch:
    gen = torch.Generator().manual_seed(3)
    b, s = 6, 20
    lengths = torch.tensor([20, 13, 17, 9, 20, 15])
    ids = torch.randint(4, 100, (b, s), generator=gen)
    out = TokenBatch(ids, lengths, torch.tensor([3, 5, 2, 4, 8, 6]))
    out.fields["advantages"] = torch.randn(b, 1, generator=gen).expand(b, s).contiguous()
    return out


def pg_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: TokenBatch) -> tuple:
    mask = mb.response_mask().float()
    loss_sum = -(log_probs * mb.fields["advantages"] * mask).sum()
    return loss_sum, mask.sum().to(torch.int), {}


def nan_gradient_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: TokenBatch) -> tuple:
    """`pg_loss`, finite, whose gradient is NaN at one position."""
    loss_sum, count, metrics = pg_loss(log_probs, entropy, mb)
    if log_probs.requires_grad:
        log_probs.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([5])), torch.tensor(torch.nan)))
    return loss_sum, count, metrics


def _actor(model_dir: Path):
    from megatron_rl.config.options import OptimizerOptions
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.parallel_layout import ParallelLayout

    options = OptimizerOptions(lr=1e-2, clip_grad=1.0)  # a large LR: the clip is active (norm > 1)
    return MegatronActor.from_hf(model_dir, ParallelLayout(), optimizer_options=options, micro_batch_tokens=64)


def _weights(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for m in actor.modules for p in m.parameters()]


def _adam_state(actor) -> list[torch.Tensor]:
    states = [s for opt in actor.optimizer.chained_optimizers for s in opt.optimizer.state.values()]
    return [v.clone() for s in states for v in s.values() if torch.is_tensor(v)]


def _old_update(actor, b: TokenBatch, loss_fn) -> float:
    """The update as `MegatronActor._update` made it before the check was folded into the norm: a pass over
    every gradient bucket (`find_nonfinite`), then Megatron's whole `optimizer.step()`."""
    from megatron_rl.megatron_backend.actor.update_metrics import find_nonfinite

    for chunk in actor.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    actor.optimizer.zero_grad()
    batches = actor._plan(b).batches

    def loss_func(mb: TokenBatch, logits: torch.Tensor):
        logp, ent = actor._token_stats(mb, logits, False, 1.0)
        loss_sum, count, _ = loss_fn(logp, ent, mb)
        count = count.to(torch.int).reshape(())
        return loss_sum, count, {"loss_sum": loss_sum.detach().float(), "metrics": {"_count": int(count)}}

    outputs, _, _ = actor._run(batches, loss_func, forward_only=False)
    assert find_nonfinite(outputs, actor.chunks, len(batches), "old") is None
    ok, grad_norm, _ = actor.optimizer.step()
    assert ok
    actor.scheduler.step(increment=1)
    return float(grad_norm)


def _per_tensor_adam(actor) -> None:
    for opt in actor.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            group.update(fused=False, foreach=False)


@pytest.mark.usefixtures("megatron_world")
def test_update_equals_megatrons_own_step(tiny_moe_dir: Path) -> None:
    new, old, per_tensor = _actor(tiny_moe_dir), _actor(tiny_moe_dir), _actor(tiny_moe_dir)
    _per_tensor_adam(per_tensor)
    assert all(g["fused"] for opt in new.optimizer.chained_optimizers for g in opt.optimizer.param_groups)
    start = _weights(new)
    for update in range(2):
        metrics = new.train_step(batch(), pg_loss)
        assert metrics["grad_norm"] > 1.0  # clipped
        assert metrics["grad_norm"] == _old_update(old, batch(), pg_loss)
        if update == 0:  # the same gradients into both Adams (later ones differ with the weights)
            _old_update(per_tensor, batch(), pg_loss)
            first, reference = _weights(new), _weights(per_tensor)
    assert all(torch.equal(a, b) for a, b in zip(_weights(new), _weights(old), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_adam_state(new), _adam_state(old), strict=True))
    moved = max(float((a - s).abs().max()) for a, s in zip(first, start, strict=True))
    eps = torch.finfo(torch.float32).eps
    # In ulps of each tensor's largest weight: Adam's update is ~lr for every element, so its rounding is too.
    worst = max(float((a - r).abs().max() / (r.abs().max() * eps)) for a, r in zip(first, reference, strict=True))
    assert moved > 1e-3 and worst <= ADAM_ULPS, (moved, worst)


@pytest.mark.usefixtures("megatron_world")
def test_nan_gradient_with_finite_losses_stops_or_is_skipped(tiny_moe_dir: Path) -> None:
    from megatron_rl.megatron_backend.actor.update_metrics import NonFiniteError

    actor = _actor(tiny_moe_dir)
    actor.train_step(batch(), pg_loss)
    weights, state, step = _weights(actor), _adam_state(actor), actor.step
    with pytest.raises(NonFiniteError, match=r"^non-finite gradient at update 7 \(every micro-batch loss is finite\)"):
        actor.train_step(batch(), nan_gradient_loss, where="update 7")
    skipped = actor.train_step(batch(), nan_gradient_loss, on_nonfinite="skip")
    assert skipped["nonfinite_skipped"] == 1.0 and actor.step == step
    assert all(torch.equal(a, b) for a, b in zip(_weights(actor), weights, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_adam_state(actor), state, strict=True))
    assert actor.train_step(batch(), pg_loss)["grad_norm"] > 0 and actor.step == step + 1  # trains on


@pytest.mark.usefixtures("megatron_world")
def test_nan_loss_names_its_micro_batch(tiny_moe_dir: Path) -> None:
    from megatron_rl.megatron_backend.actor.update_metrics import NonFiniteError

    calls = []

    def nan_in_second(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: TokenBatch) -> tuple:
        calls.append(mb.size)
        loss_sum, count, metrics = pg_loss(log_probs, entropy, mb)
        return (loss_sum * torch.nan if len(calls) == 2 else loss_sum), count, metrics

    actor = _actor(tiny_moe_dir)
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 1, micro-batch 2 of 2 \(loss_sum=nan\)"):
        actor.train_step(batch(), nan_in_second, where="step 1")
    assert len(calls) == 2


@pytest.mark.torchrun
@pytest.mark.slow
def test_nan_gradient_on_one_rank_is_detected(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """DP=2 with the distributed optimizer: rank 1's NaN reaches the norm through the reduce-scatter into
    the shard one of the ranks owns; both ranks refuse, then skip, the update and keep their weights."""
    out = tmp_path / "ranks.json"
    run_torchrun(SCRIPT, 2, ["--model", str(tiny_moe_dir), "--out", str(out)])
    got = json.loads(out.read_text())
    for rank in ("0", "1"):
        assert got[rank]["stop"].startswith("non-finite gradient at update 2 (every micro-batch loss is finite)")
        assert got[rank]["skipped"] == 1.0 and got[rank]["weights_kept"] and got[rank]["step"] == 1


@pytest.mark.usefixtures("megatron_world")
def test_one_rank_buffer_collectives_are_the_identity() -> None:
    """The CPU bridge returns at once from the distributed optimizer's in-place all-gather and DDP's in-place
    reduce-scatter over one rank (what gloo would copy onto itself); an out-of-place call still runs gloo's."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import param_and_grad_buffer as buffers

    group = ps.get_data_parallel_group()
    buffer = torch.randn(1000)
    kept = buffer.clone()
    assert buffers.dist_all_gather_func(buffer, buffer.view(-1)[:], group=group) is None
    assert buffers.dist_reduce_scatter_func(buffer.view(-1)[:], buffer, group=group) is None
    assert torch.equal(buffer, kept)
    gathered = torch.zeros(1000)
    buffers.dist_all_gather_func(gathered, buffer, group=group)
    assert torch.equal(gathered, kept)
