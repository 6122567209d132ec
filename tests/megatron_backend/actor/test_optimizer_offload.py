"""Optimizer memory features: Megatron-Core's CPU offload (`HybridDeviceOptimizer`) and precision-aware optimizer.

On CPU: the config keys map onto Megatron-Core's `OptimizerConfig` fields (this tier's version, 0.16 or 0.19);
the combinations Megatron cannot run are refused at config load with the key and the fix; a CPU run refuses
what needs CUDA or Transformer Engine before Megatron fails obscurely (its hybrid optimizer takes a parameter
already on the host for a copy of a GPU one: KeyError at the first step); resetting the optimizer state keeps
the main parameters some optimizers hold in it.
On CUDA (scripts/gpu_check.sh): the offloaded optimizer trains like the resident one, its state lives in host
memory, and a checkpoint resume with it continues bit for bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.options import OptimizerOptions
from megatron_rl.megatron_backend.actor.training_setup import (
    check_optimizer_platform,
    optimizer_config_fields,
    zero_optimizer_state,
)
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

REPO = Path(__file__).resolve().parents[3]
OFFLOAD = ("model.options.dtype=bf16", "optimizer.cpu_offload=true", "optimizer.precision_aware=true")
ON_CUDA = torch.cuda.is_available()


def _load(*overrides: str):
    return load_config(REPO / "examples" / "tiny_moe_gspo.yaml", list(overrides))


# ---------------------------------------------------------------------------------- config


def test_the_offload_recipe_is_accepted() -> None:
    cfg = _load(*OFFLOAD, "optimizer.offload_fraction=0.5", "optimizer.overlap_offload_transfers=false")
    assert cfg.optimizer.cpu_offload and cfg.optimizer.offload_fraction == 0.5
    pa = _load("model.options.dtype=bf16", "optimizer.precision_aware=true", "optimizer.moments_dtype=fp8",
               "optimizer.main_params_dtype=fp16")  # fmt: skip
    assert pa.optimizer.moments_dtype == "fp8"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ((*OFFLOAD, "optimizer.distributed_optimizer=false"),
         "optimizer.cpu_offload=true offloads the distributed optimizer's shards: set "
         "optimizer.distributed_optimizer=true"),
        (("model.options.dtype=bf16", "optimizer.cpu_offload=true"),
         "optimizer.cpu_offload=true needs optimizer.precision_aware=true"),
        ((*OFFLOAD, "optimizer.offload_fraction=0"), "optimizer.offload_fraction=0.0 must be in (0, 1]"),
        ((*OFFLOAD, "optimizer.moments_dtype=bf16"),
         "optimizer.moments_dtype='bf16' with optimizer.cpu_offload=true: the host optimizer"),
        ((*OFFLOAD, "optimizer.main_params_dtype=fp16"), "set optimizer.main_params_dtype=fp32"),
        (("optimizer.precision_aware=true",),
         "optimizer.precision_aware=true with model.options.dtype='fp32'"),
        (("model.options.dtype=bf16", "optimizer.precision_aware=true", "optimizer.distributed_optimizer=false"),
         "optimizer.precision_aware=true needs optimizer.distributed_optimizer=true"),
        (("optimizer.moments_dtype=bf16",), "optimizer.moments_dtype='bf16' needs optimizer.precision_aware=true"),
    ],
)  # fmt: skip
def test_combinations_megatron_cannot_run_are_refused_by_key(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(*overrides)
    assert message in str(err.value), str(err.value)


def test_options_map_onto_megatron_optimizer_config_fields() -> None:
    """By hand, and every key is a field of this tier's `OptimizerConfig` (the names are alike in 0.16 and 0.19)."""
    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron.core.optimizer import OptimizerConfig

    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    opt = OptimizerOptions(cpu_offload=True, precision_aware=True, offload_fraction=0.5)
    fields = optimizer_config_fields(opt, bf16=True)
    assert set(fields) <= names, set(fields) - names
    assert (fields["optimizer_cpu_offload"], fields["optimizer_offload_fraction"]) == (True, 0.5)
    assert fields["overlap_cpu_optimizer_d2h_h2d"] and fields["use_precision_aware_optimizer"]
    assert fields["main_params_dtype"] == fields["exp_avg_dtype"] == fields["exp_avg_sq_dtype"] == torch.float32
    assert fields["store_param_remainders"] is False and fields["params_dtype"] == torch.bfloat16

    fp8 = optimizer_config_fields(OptimizerOptions(precision_aware=True, moments_dtype="fp8"), bf16=True)
    assert fp8["exp_avg_dtype"] == fp8["exp_avg_sq_dtype"] == torch.uint8  # TE FusedAdam's fp8 moments
    assert "store_param_remainders" not in fp8  # Megatron's default (TE >= 2.1: remainders) without offload

    plain = optimizer_config_fields(OptimizerOptions(), bf16=False)
    assert not plain["optimizer_cpu_offload"] and plain["optimizer_offload_fraction"] == 0.0
    assert not plain["overlap_cpu_optimizer_d2h_h2d"] and "exp_avg_dtype" not in plain
    config = OptimizerConfig(**plain)  # Megatron's own __post_init__ accepts it
    assert config.decoupled_weight_decay  # AdamW, which its CPU offload requires


@pytest.mark.skipif(ON_CUDA, reason="the CPU refusals")
def test_a_cpu_run_refuses_what_needs_cuda_or_transformer_engine() -> None:
    with pytest.raises(ValueError, match=r"optimizer.cpu_offload=true moves .* set optimizer.cpu_offload=false"):
        check_optimizer_platform(OptimizerOptions(cpu_offload=True))
    with pytest.raises(ValueError, match=r"optimizer.precision_aware=true needs Transformer Engine"):
        check_optimizer_platform(OptimizerOptions(cpu_offload=True, precision_aware=True))
    check_optimizer_platform(OptimizerOptions())  # the resident optimizer runs anywhere


@pytest.mark.skipif(ON_CUDA, reason="what Megatron's hybrid optimizer does with host parameters")
@pytest.mark.usefixtures("megatron_world")
def test_megatron_hybrid_optimizer_cannot_step_parameters_already_on_the_host() -> None:
    """Why a CPU run refuses optimizer.cpu_offload: the HybridDeviceOptimizer (streams bridged to no-ops on CPU)
    puts every host parameter in its CPU group and then looks each up as the copy of a GPU parameter. If a
    Megatron-Core release makes this step work, this test fails: lift the refusal in `check_optimizer_platform`."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    param = torch.nn.Parameter(torch.ones(4))
    hybrid = HybridDeviceOptimizer(
        [param], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True, lr=0.1,
    )  # fmt: skip
    assert hybrid.gpu_optimizer is None and len(hybrid.cpu_optimizers) == 1 and not hybrid.gpu_params_map_cpu_copy
    param.grad = torch.ones(4)
    with pytest.raises(KeyError):
        hybrid.step()


def test_reset_keeps_main_parameters_held_in_the_optimizer_state() -> None:
    """FusedAdam (precision-aware) and the hybrid device optimizer keep `master_param` next to the moments."""
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    adam = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.tensor([0.5, 0.25])
    adam.step()
    master = param.detach().clone()
    adam.state[param]["master_param"] = master
    adam.param_groups[0]["step"] = 1  # where FusedAdam counts
    zero_optimizer_state(adam)
    state = adam.state[param]
    assert state["step"] == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert torch.equal(state["master_param"], master) and master.abs().sum() > 0
    assert adam.param_groups[0]["step"] == 0


# ---------------------------------------------------------------------------------- CUDA

needs_offload_platform = pytest.mark.skipif(
    not ON_CUDA, reason="Megatron's CPU offload needs GPU parameters and Transformer Engine (scripts/gpu_check.sh)"
)


def _actor(model: Path, **optimizer):
    from megatron_rl.megatron_backend import platform
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.parallel_layout import ParallelLayout

    if optimizer.get("precision_aware") and not platform.transformer_engine_available():
        pytest.skip("the precision-aware optimizer needs Transformer Engine")
    return MegatronActor.from_hf(
        model,
        ParallelLayout(),
        model_options=ModelOptions(dtype="bf16"),
        optimizer_options=OptimizerOptions(lr=1e-3, **optimizer),
        micro_batch_tokens=64,
    )


def _weights(actor) -> dict[str, torch.Tensor]:
    modules = enumerate(actor.modules)
    return {f"{i}.{n}": p.detach().float().clone() for i, m in modules for n, p in m.named_parameters()}


@needs_offload_platform
@pytest.mark.usefixtures("megatron_world")
def test_offloaded_optimizer_trains_like_the_resident_one(tiny_moe_dir: Path) -> None:
    """Three updates of the same batch: the same AdamW math on fp32 main parameters and moments, on the host
    (torch's fused CPU AdamW) instead of the GPU, so the bf16 weights agree to within rounding (two bf16 ulps);
    the first update's loss is the same number (nothing has stepped yet)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megatron_rl.megatron_backend.actor.training_setup import inner_optimizers
    from tests.megatron_backend.actor.test_offload import _batch, _loss_fn

    resident = _actor(tiny_moe_dir)
    offloaded = _actor(tiny_moe_dir, cpu_offload=True, precision_aware=True)
    hybrids = [opt.optimizer for opt in inner_optimizers(offloaded.optimizer)]  # dense and expert parameters
    assert hybrids and all(isinstance(h, HybridDeviceOptimizer) and h.offload_fraction == 1.0 for h in hybrids)
    assert all(h.gpu_optimizer is None and len(h.cpu_optimizers) > 1 for h in hybrids)  # one per shard: overlap
    initial = _weights(resident)
    batch = _batch()
    batch.fields["old_log_probs"] = resident.compute_log_probs(batch).log_probs
    losses = [(resident.train_step(batch, _loss_fn), offloaded.train_step(batch, _loss_fn)) for _ in range(3)]
    assert losses[0][0]["loss"] == losses[0][1]["loss"]
    assert losses[0][1]["grad_norm"] == pytest.approx(losses[0][0]["grad_norm"], rel=1e-5)
    for want, got in losses[1:]:
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-2, abs=1e-4)
    states = [t for h in hybrids for s in h.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert states and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in states)
    want, got = _weights(resident), _weights(offloaded)
    for name in want:
        ulp = want[name].abs() * 2**-7 + 1e-8
        assert bool(((got[name] - want[name]).abs() <= 2 * ulp).all()), name
    assert any(not torch.equal(want[n], initial[n]) for n in want)  # it trained


@needs_offload_platform
@pytest.mark.usefixtures("megatron_world")
def test_checkpoint_resume_with_the_offloaded_optimizer_is_exact(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """Two updates, save, two more; a fresh offloaded actor loaded from the checkpoint makes the same two
    updates bit for bit (the host optimizer's fp32 main parameters, moments and step come back)."""
    from megatron_rl.megatron_backend.checkpoint.dist_checkpoint import load_checkpoint, save_checkpoint
    from tests.megatron_backend.actor.test_offload import _batch, _loss_fn

    options = dict(cpu_offload=True, precision_aware=True)
    first = _actor(tiny_moe_dir, **options)
    batch = _batch()
    batch.fields["old_log_probs"] = first.compute_log_probs(batch).log_probs
    for _ in range(2):
        first.train_step(batch, _loss_fn)
    path = save_checkpoint(first, tmp_path, 2, {"step": 2})
    want = [first.train_step(batch, _loss_fn) for _ in range(2)]
    resumed = _actor(tiny_moe_dir, **options)
    load_checkpoint(resumed, path)
    assert [resumed.train_step(batch, _loss_fn) for _ in range(2)] == want
    a, b = _weights(first), _weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
