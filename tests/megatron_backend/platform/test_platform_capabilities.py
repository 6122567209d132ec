"""The platform package is the one place that calls `torch.cuda`, and its capability functions on the CPU."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.platform import mcore_compat

PACKAGE = Path(__file__).resolve().parents[3] / "megatron_rl"
PLATFORM = PACKAGE / "megatron_backend" / "platform"
ACCELERATOR = PACKAGE / "accelerator.py"  # the platform's device capabilities, Megatron-free (the rollout asks it too)
CUDA_CALL = re.compile(r"\btorch\.cuda\.\w")

ALLOWED: dict[str, str] = {}
"""Modules outside the platform package that may still name `torch.cuda.` (module path -> reason). None today."""


def _direct_cuda_calls(path: Path) -> list[str]:
    """'LINE: text' of each line of `path` that calls into `torch.cuda.` (a name in backquotes, as prose quotes it,
    or in a comment is not a call)."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = re.sub(r"`[^`]*`", "", line.split("#", 1)[0])
        if CUDA_CALL.search(code):
            found.append(f"{number}: {line.strip()}")
    return found


def test_no_direct_torch_cuda_call_outside_the_platform_package() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if PLATFORM not in path.parents and path != ACCELERATOR and str(path.relative_to(PACKAGE.parent)) not in ALLOWED
        for hit in _direct_cuda_calls(path)
    ]
    assert offenders == [], "ask megatron_rl.megatron_backend.platform instead:\n" + "\n".join(offenders)


def test_the_guard_finds_a_call(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('x = 1  # torch.cuda.synchronize() in a comment\n"""`torch.cuda.Event` in prose"""\n')
    assert _direct_cuda_calls(module) == []
    module.write_text("import torch\ntorch.cuda.synchronize()\n")
    assert _direct_cuda_calls(module) == ["2: torch.cuda.synchronize()"]


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answers of the capabilities")


@cpu_only
def test_empty_host_pins_only_where_pinning_exists() -> None:
    for pinned in (False, True):
        buffer = platform.empty_host((2, 3), torch.bfloat16, pinned=pinned)
        assert buffer.shape == (2, 3) and buffer.dtype == torch.bfloat16 and buffer.device.type == "cpu"
        assert not buffer.is_pinned()


@cpu_only
def test_accelerator_rng_state_is_none_on_cpu_and_the_cpu_generator_untouched() -> None:
    torch.manual_seed(7)
    cpu_state = torch.get_rng_state()
    assert platform.accelerator_rng_state() is None
    platform.set_accelerator_rng_state(None)
    platform.set_accelerator_rng_state(torch.zeros(8, dtype=torch.uint8))  # ignored without an accelerator
    assert torch.equal(torch.get_rng_state(), cpu_state)
    first = torch.rand(3)
    torch.set_rng_state(cpu_state)
    assert torch.equal(torch.rand(3), first)


@cpu_only
def test_counters_and_device_answers_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert platform.memory_allocated(cpu) is None
    assert platform.device_capability(cpu) == (0, 0)
    assert platform.accelerator_names() == []
    platform.synchronize()  # returns at once: nothing is queued on the CPU
    assert platform.default_collective_backend() == "gloo"
    assert platform.collective_device("gloo") == cpu
    assert platform.current_accelerator_index() is None


def test_version_switches_name_their_releases() -> None:
    def save(state: dict, path: str, *, async_strategy: str = "nvrx") -> None: ...

    assert mcore_compat.save_takes_async_strategy(save)
    assert not mcore_compat.save_takes_async_strategy(lambda state, path: None)
    version = mcore_compat.installed_megatron_version()
    assert mcore_compat.dist_checkpoint_common_file() == (None if version.startswith("0.19.") else "common.pt")


def test_spec_submodules_of_both_spec_forms() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Submodules:
        a: int = 1
        b: int = 2

    @dataclasses.dataclass
    class Spec:
        module: type
        submodules: Submodules

    spec = Spec(int, Submodules())
    assert mcore_compat.spec_submodules(spec) is spec.submodules
    changed = mcore_compat.spec_with_submodules(spec, b=3)
    assert changed.submodules == Submodules(1, 3) and spec.submodules == Submodules(1, 2)
    partial = functools.partial(Spec, int, submodules=Submodules())
    changed_partial = mcore_compat.spec_with_submodules(partial, a=5)
    assert mcore_compat.spec_submodules(changed_partial) == Submodules(5, 2)
    assert mcore_compat.spec_submodules(partial) == Submodules(1, 2)
