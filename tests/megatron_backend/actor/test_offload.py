"""Offloading the actor's training state to host memory while a colocated rollout engine generates.

Storage-level unit tests of `StorageOffload`, then a real `MegatronActor` (one process, gloo, TP=1): two
train steps with an offload/reload between them must equal the same two steps without it, bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.megatron_backend.actor.offload import StorageOffload
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

# ---------------------------------------------------------------------------------- StorageOffload


def test_shared_storage_moves_once_and_comes_back_bitwise() -> None:
    flat = torch.randn(1000)
    views = [flat[:300].view(10, 30), flat[300:], flat.view(-1, 8)[3]]  # DDP-buffer style views
    other = torch.randn(7, 5, dtype=torch.float64)
    alias = other.t()
    before = [flat.clone(), other.clone()]
    offload = StorageOffload([flat, *views, other, alias, torch.empty(0)])

    assert offload.num_storages == 2
    assert offload.nbytes == flat.untyped_storage().nbytes() + other.untyped_storage().nbytes() == 4000 + 280
    stats = offload.offload()
    assert (stats.bytes, stats.storages) == (4280, 2) and stats.gib == 4280 / 2**30
    assert offload.offloaded
    assert all(t.untyped_storage().nbytes() == 0 for t in [flat, *views, other, alias])
    assert views[0].shape == (10, 30)  # the views survive as objects

    stats = offload.reload()
    assert (stats.bytes, stats.storages) == (4280, 2) and not offload.offloaded
    assert torch.equal(flat, before[0]) and torch.equal(other, before[1])
    assert torch.equal(views[1], before[0][300:]) and torch.equal(alias, before[1].t())
    flat[0] = 42.0  # the views still alias the reallocated storage
    assert views[0][0, 0] == 42.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory (runs in scripts/gpu_check.sh)")
def test_offload_frees_cuda_memory_and_pins_the_host_copy() -> None:
    buffer = torch.randn(64 << 20, device="cuda")  # 256 MiB
    views = [buffer[: 1 << 20], buffer.view(1024, -1)[5]]
    expected = buffer.clone().cpu()
    offload = StorageOffload([buffer, *views])
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    offload.offload()
    assert before[0] - torch.cuda.memory_allocated() == 256 << 20
    assert before[1] - torch.cuda.memory_reserved() >= 256 << 20  # returned to the driver, not only cached
    assert all(host.is_pinned() for host in offload._host)
    offload.reload()
    assert torch.cuda.memory_allocated() == before[0] and torch.equal(buffer.cpu(), expected)


def test_bytes_are_exact_for_several_dtypes() -> None:
    tensors = [torch.ones(3, dtype=d) for d in (torch.bfloat16, torch.float32, torch.int64, torch.bool)]
    offload = StorageOffload(tensors)
    assert offload.offload().bytes == 3 * (2 + 4 + 8 + 1)
    offload.reload()
    assert all(bool((t == 1).all()) for t in tensors)


def test_misuse_raises() -> None:
    offload = StorageOffload([torch.zeros(4)])
    with pytest.raises(RuntimeError, match="not offloaded"):
        offload.reload()
    offload.offload()
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload.offload()
    offload.reload()
    with pytest.raises(RuntimeError, match="not offloaded"):
        offload.reload()
    offload.offload()  # a second cycle works
    offload.reload()


# ---------------------------------------------------------------------------------- MegatronActor


def _actor(model: Path, *, train: bool = True, distributed_optimizer: bool = True, dtype: str = "fp32"):
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.parallel_layout import ParallelLayout

    optimizer = OptimizerOptions(lr=1e-3, distributed_optimizer=distributed_optimizer) if train else None
    return MegatronActor.from_hf(
        model,
        ParallelLayout(),
        model_options=ModelOptions(dtype=dtype),
        optimizer_options=optimizer,
        micro_batch_tokens=64,
    )


def _batch():
    from megatron_rl.megatron_backend.actor.batch import TokenBatch

    gen = torch.Generator().manual_seed(3)
    b, s = 6, 20
    ids = torch.randint(4, 100, (b, s), generator=gen)
    lengths = torch.randint(10, s + 1, (b,), generator=gen)
    for i in range(b):
        ids[i, lengths[i] :] = 3
    batch = TokenBatch(ids, lengths, torch.randint(3, 8, (b,), generator=gen))
    batch.fields["advantages"] = torch.linspace(-1.0, 1.0, b).unsqueeze(1).expand(b, s).contiguous()
    return batch


def _loss_fn(logp, ent, mb):
    from megatron_rl.algorithms import policy_loss

    mask = mb.response_mask().float()
    loss, metrics = policy_loss("ppo", logp, mb.fields["old_log_probs"], mb.fields["advantages"], mask)
    count = mask.sum().to(torch.int)
    return loss * count, count, {"ppo_kl": metrics["ppo_kl"], "clip_frac_high": metrics["clip_frac_high"]}


def _optimizer_tensors(actor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(main params, state tensors) of every optimizer of the actor."""
    params, states = [], []
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in opt.optimizer.param_groups:
            params += group["params"]
        for state in opt.optimizer.state.values():
            states += [v for v in state.values() if torch.is_tensor(v)]
    return params, states


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _weights(actor) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, m in enumerate(actor.modules) for n, p in m.named_parameters()}


@pytest.mark.parametrize(
    ("distributed_optimizer", "dtype"), [(True, "fp32"), (False, "bf16")], ids=["distopt_fp32", "plain_bf16"]
)
@pytest.mark.usefixtures("megatron_world")
def test_train_offload_reload_train_equals_no_offload(
    tiny_moe_dir: Path, distributed_optimizer: bool, dtype: str
) -> None:
    plain = _actor(tiny_moe_dir, distributed_optimizer=distributed_optimizer, dtype=dtype)
    parked = _actor(tiny_moe_dir, distributed_optimizer=distributed_optimizer, dtype=dtype)
    batch = _batch()
    batch.fields["old_log_probs"] = plain.compute_log_probs(batch).log_probs
    assert torch.equal(parked.compute_log_probs(batch).log_probs, batch.fields["old_log_probs"])
    assert plain.train_step(batch, _loss_fn) == parked.train_step(batch, _loss_fn)

    main_params, states = _optimizer_tensors(parked)
    model_params = [p for m in parked.modules for p in m.parameters()]
    main_grads = [p.main_grad for p in model_params]
    expected_min = _nbytes(model_params) + _nbytes(states) + (_nbytes(main_params) if dtype == "bf16" else 0)
    assert len(states) >= 2 * len(main_params)  # exp_avg and exp_avg_sq exist after the first step

    on_cuda = torch.cuda.is_available()
    allocated = torch.cuda.memory_allocated() if on_cuda else 0
    stats = parked.offload()
    if on_cuda:  # the device memory really went (and the caching allocator handed it back)
        assert allocated - torch.cuda.memory_allocated() >= stats.bytes * 0.99
    assert parked.offloaded
    assert stats.bytes >= expected_min, (stats.bytes, expected_min)
    for tensor in model_params + main_grads + main_params + states:
        assert tensor.untyped_storage().nbytes() == 0
    for chunk in parked.chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            assert buffer.grad_data.untyped_storage().nbytes() == 0
            assert buffer.param_data is None or buffer.param_data.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="already offloaded"):
        parked.offload()
    with pytest.raises(RuntimeError, match="offloaded; call reload"):
        parked.train_step(batch, _loss_fn)
    with pytest.raises(RuntimeError, match="offloaded; call reload"):
        parked.compute_log_probs(batch)

    # The "rollout engine" allocates while the actor is parked: the freed memory gets reused.
    plain_scores = plain.compute_log_probs(batch, with_entropy=True)
    assert parked.reload().bytes == stats.bytes
    assert not parked.offloaded
    with pytest.raises(RuntimeError, match="not offloaded"):
        parked.reload()
    parked_scores = parked.compute_log_probs(batch, with_entropy=True)
    assert torch.equal(parked_scores.log_probs, plain_scores.log_probs)
    assert torch.equal(parked_scores.entropy, plain_scores.entropy)

    second_plain, second_parked = plain.train_step(batch, _loss_fn), parked.train_step(batch, _loss_fn)
    assert second_plain == second_parked and second_plain["ppo_kl"] != 0.0
    assert torch.equal(plain.compute_log_probs(batch).log_probs, parked.compute_log_probs(batch).log_probs)
    want, got = _weights(plain), _weights(parked)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    (want_main, want_states), (got_main, got_states) = _optimizer_tensors(plain), _optimizer_tensors(parked)
    assert all(torch.equal(a, b) for a, b in zip(want_main + want_states, got_main + got_states, strict=True))


@pytest.mark.usefixtures("megatron_world")
def test_scoring_only_actor_offloads_parameters(tiny_moe_dir: Path) -> None:
    actor = _actor(tiny_moe_dir, train=False)
    batch = _batch()
    before = actor.compute_log_probs(batch).log_probs
    params = [p for m in actor.modules for p in m.parameters()]
    stats = actor.offload()
    assert stats.bytes >= _nbytes(params)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    with pytest.raises(RuntimeError, match="offloaded; call reload"):
        actor.export_hf()
    actor.reload()
    assert torch.equal(actor.compute_log_probs(batch).log_probs, before)
