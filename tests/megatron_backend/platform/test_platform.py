"""Tests for `megatron_rl.megatron_backend.platform`: version guard, CPU bridges, and a tiny MoE
GPT trained in one process through Megatron's DDP, optimizer and schedule."""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.platform import mcore_compat
from megatron_rl.parallel_layout import ParallelLayout

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def test_version_guard_rejects_untested_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mcore_compat, "installed_megatron_version", lambda: "0.17.0")
    with pytest.raises(RuntimeError) as err:
        platform.check_megatron_version()
    message = str(err.value)
    assert "0.17.0" in message and "0.16.x" in message and "0.19.x" in message
    with pytest.raises(RuntimeError, match="0.17.0"):
        platform.prepare_megatron_import()


def test_version_guard_refuses_untested_release_only_where_bridges_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="0.17.0"):
        platform.check_megatron_version("0.17.0", device_type="cpu")
    # On CUDA nothing is patched: the untested release is named in a warning and accepted.
    with pytest.warns(UserWarning, match=r"megatron-core 0\.17\.0 is untested .*tested: 0\.16\.x, 0\.19\.x"):
        assert platform.check_megatron_version("0.17.0", device_type="cuda") == "0.17.0"
    monkeypatch.setattr(mcore_compat, "installed_megatron_version", lambda: "0.20.0")
    with pytest.warns(UserWarning, match="0.20.0"):
        assert platform.prepare_megatron_import(device_type="cuda") == "0.20.0"
    with pytest.raises(RuntimeError, match="0.20.0"):
        platform.prepare_megatron_import(device_type="cpu")
    with pytest.raises(ValueError, match="device_type"):
        platform.check_megatron_version("0.17.0", device_type="mps")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_version_guard_is_silent_for_supported_releases(device_type: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert platform.check_megatron_version("0.19.2", device_type=device_type) == "0.19.2"
        assert platform.check_megatron_version("0.16.1", device_type=device_type) == "0.16.1"


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_version_guard_accepts_supported_releases(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(mcore_compat, "installed_megatron_version", lambda: version)
    assert platform.check_megatron_version() == version


def test_paged_stash_stub_for_019_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    if PAGED_STASH in sys.modules:
        pytest.skip("the real paged_stash ops module is already imported")
    real_find_spec = platform.importlib.util.find_spec
    monkeypatch.setattr(mcore_compat, "installed_megatron_version", lambda: "0.19.2")
    monkeypatch.setattr(
        platform.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    try:
        platform.prepare_megatron_import()
        stub = sys.modules[PAGED_STASH]
        assert stub.GLOBAL_BLOCK_SIZE == 1024
        assert stub.paged_stash_copy_kernel is None and stub.paged_stash_pop_kernel is None
        platform.prepare_megatron_import()
        assert sys.modules[PAGED_STASH] is stub  # idempotent
    finally:
        sys.modules.pop(PAGED_STASH, None)


def test_no_stub_for_016(monkeypatch: pytest.MonkeyPatch) -> None:
    if PAGED_STASH in sys.modules:
        pytest.skip("the real paged_stash ops module is already imported")
    monkeypatch.setattr(mcore_compat, "installed_megatron_version", lambda: "0.16.1")
    platform.prepare_megatron_import()
    assert PAGED_STASH not in sys.modules


def test_bridge_is_idempotent() -> None:
    first = platform.bridge_cpu()
    current_device = torch.cuda.current_device
    second = platform.bridge_cpu()
    assert second is first
    assert torch.cuda.current_device is current_device  # not wrapped twice
    assert first.device == "cpu" and first.backend == "gloo"
    assert first.mcore_version == platform.installed_megatron_version()
    assert "torch.cuda.current_device" in first.bridges
    assert platform.device() == torch.device("cpu") and platform.dist_backend() == "gloo"
    with pytest.raises(RuntimeError, match="already applied"):
        platform.bridge_cpu(enable=False)


def test_no_process_wide_torch_function_mode() -> None:
    platform.bridge_cpu()
    assert torch.overrides._get_current_function_mode_stack() == []
    assert not torch._C._is_torch_function_mode_enabled()
    # Outside the bridged Megatron modules, torch is untouched: "cuda" stays an error on a CPU build.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(3, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(3).cuda()
    assert torch.zeros(3).type() == "torch.FloatTensor"


def test_megatron_jit_fuser_is_eager_on_cpu() -> None:
    """A fresh process: after `prepare_megatron_import`, Megatron's fused functions are plain functions, not
    torch.compile wrappers (on 0.16.1 inductor is then never imported, ~1.4 s of every start; 0.19.2 imports it
    elsewhere); the GPU keeps Megatron's own."""
    import subprocess

    code = (
        "from megatron_rl.megatron_backend import platform\n"
        "platform.prepare_megatron_import()\n"
        "import megatron.core.models.gpt\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
        "from megatron.core.jit import jit_fuser\n"
        "print(jit_fuser(len) is len, type(bias_swiglu).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "function"], out.stdout + out.stderr[-2000:]


def test_device_literals_in_bridged_megatron_modules_go_to_cpu() -> None:
    platform.bridge_cpu()
    from megatron.core.pipeline_parallel import schedules

    assert isinstance(schedules.torch, platform.CpuPlacedTorch)
    assert schedules.torch.Tensor is torch.Tensor and schedules.torch.cuda is torch.cuda
    x = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert x.device.type == "cpu" and x.dtype == torch.int
    assert schedules.torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert any(__file__ in site for site in platform.cuda_hits()["device='cuda'"])
    assert "CUDA-HIT device='cuda' x" in platform.format_cuda_hits()


def test_optimizer_type_checks_accept_cpu_tensors() -> None:
    platform.bridge_cpu()
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)  # norm 4
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(param.grad, torch.full((4,), 0.5), rtol=1e-5)
    hits = platform.cuda_hits()
    assert any(s.startswith("megatron/core/optimizer/clip_grads.py") for s in hits["Tensor.type()"])
    assert any(s.startswith("megatron/core/optimizer/clip_grads.py") for s in hits["device='cuda'"])
    name = platform.CpuTypeName("torch.FloatTensor")
    assert name == "torch.FloatTensor" and "torch.FloatTensor" == name and name != "torch.cuda.FloatTensor"
    assert hash(name) == hash("torch.FloatTensor")
    assert torch.zeros(1, dtype=torch.half).type() not in (name,)


def test_cuda_rng_maps_to_cpu_generator() -> None:
    platform.bridge_cpu()
    torch.cuda.manual_seed(7)
    a = torch.rand(4)
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())
    torch.manual_seed(7)  # calls torch.cuda.manual_seed_all: must not recurse
    assert torch.equal(a, torch.rand(4))


def test_tiny_moe_trains_with_megatron_ddp_optimizer_and_schedule(megatron_world) -> None:
    from tests import dist_harness

    model = dist_harness.TinyMoE(num_layers=2)
    trainer = dist_harness.make_trainer(model, ParallelLayout(), seed=1234)
    modes_seen = []

    def record_modes(*_: object) -> None:
        modes_seen.append(
            (len(torch.overrides._get_current_function_mode_stack()), torch._C._is_torch_function_mode_enabled())
        )

    layers = [m for chunk in trainer.chunks for m in chunk.modules() if type(m).__name__ == "TransformerLayer"]
    handles = [layer.register_forward_pre_hook(record_modes) for layer in layers]
    handles += [layer.register_full_backward_hook(record_modes) for layer in layers]
    try:
        result = dist_harness.train(trainer, model.token_batches(3, seed=7))
    finally:
        for handle in handles:
            handle.remove()
    # Forward and backward (and so the whole step) ran with no torch-function mode active.
    assert modes_seen and set(modes_seen) == {(0, False)}, set(modes_seen)
    losses = result["loss"]
    assert all(math.isfinite(v) for v in losses + result["grad_norm"])
    assert losses[0] > losses[1] > losses[2], losses
    assert 4.0 < losses[0] < 5.5  # ~ln(128) = 4.85 at init
    hits = platform.cuda_hits()
    # The bridges really were on the path (a sample of what 0.16.1 and 0.19.x both hit).
    assert any(s.startswith("megatron/core/transformer/moe/router.py") for s in hits["torch.cuda.current_device"])
    assert any(s.startswith("megatron/core/pipeline_parallel/schedules.py") for s in hits["device='cuda'"])
    assert any(s.startswith("megatron/core/optimizer/clip_grads.py") for s in hits["Tensor.type()"])


def test_vocab_parallel_logprobs_equal_log_softmax(megatron_world) -> None:
    from megatron.core import tensor_parallel

    from tests import dist_harness

    model = dist_harness.TinyMoE(num_layers=2)
    chunks, _ = model.build(ParallelLayout())
    dist_harness.init_layout_independent_(chunks, seed=1234)
    tokens = model.token_batches(1, seed=3)[0]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(model.seq_length).unsqueeze(0).expand_as(inputs)
    with torch.no_grad():
        logits = chunks[0](inputs, positions, attention_mask=None)
        logprobs = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)
        reference = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert logprobs.shape == labels.shape
    assert (logprobs - reference).abs().max().item() <= 1e-6
