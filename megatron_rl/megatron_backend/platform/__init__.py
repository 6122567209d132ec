"""The one place where CPU-vs-GPU and Megatron-Core 0.16-vs-0.19 differences live.

Production runs on CUDA with NCCL and needs none of this: `bridge_cpu()` is a no-op there.
CI runs Megatron-Core on CPU with gloo. Megatron assumes CUDA in a few dozen places;
`bridge_cpu()` maps each of them onto the CPU, once per process:

* torch.cuda entry points: current_device -> cpu; synchronize, empty_cache, set_device,
  nvtx ranges -> no-ops; Stream / Event / stream() / current_stream -> no-op stand-ins;
  get/set_rng_state and manual_seed -> the CPU generator (manual_seed_all -> no-op);
* Megatron functions: get_default_causal_mask and get_sliding_window_causal_mask (hard-coded device="cuda"); the
  model-parallel RNG tracker's _get/_set_cuda_rng_state; the alltoall dispatcher's
  maybe_move_tensor_to_cpu (split sizes stay tensors on CPU); the local spec's
  WrappedTorchNorm under sequence parallelism; 0.16.x only: moe_utils.te_general_gemm;
* device="cuda" literals (the schedules' token counters, the optimizer's scalars and
  grad-norm buffers, ...): the Megatron modules that write them (`DEVICE_LITERAL_MODULES`)
  see a `CpuPlacedTorch` as their `torch`, whose tensor factories place "cuda" on the CPU;
* the optimizer's `Tensor.type() == "torch.cuda.FloatTensor"` checks: in the functions of
  `TYPE_CHECK_MODULES` the CUDA type-name constants become the CPU names (`CpuTypeName`).
* a gloo cost NCCL does not have: DDP's and the distributed optimizer's in-place reduce-scatter and
  all-gather of whole buffers over a group of one rank (the identity) return at once.

The package: `cpu_bridge` (the bridges above), `ledger` (`cuda_hits()`), `megatron_rl.accelerator` (device
capabilities, Megatron-free so the rollout side asks it too: pinned host buffers, the accelerator's RNG state, memory
counters, synchronisation, the collective device) and
`mcore_compat` (the version guard and each Megatron-Core 0.16/0.19 difference as a named function). Their public
names are importable from here.

What is set process-wide, and why. On CPU only, `bridge_cpu()` replaces the `torch.cuda` and `torch.cuda.nvtx`
attributes of the first item in those modules themselves, so every caller in the process sees the stand-ins:
Megatron reaches them as `torch.cuda.<name>` from too many call sites to bridge one by one, and on a CPU-only
torch the originals raise. The other items rebind names in Megatron's own modules (process-wide as well, but read
only by Megatron). `prepare_megatron_import()` adds warning filters (`KNOWN_BACKEND_WARNINGS`) and registers
stand-in modules in `sys.modules` (`megatron.core.jit` on CPU; 0.19.x's triton-only paged-stash ops where triton
is absent). On CUDA nothing but the warning filters is set. None of this is a hook on a hot path: there is no
torch-function mode or dispatcher hook, so a forward, a backward or a `transformers` generate call in the same
process pays nothing for the bridges (a TorchFunctionMode entered for the whole process would cost ~0.36 s of a
0.54 s demo step). A Megatron path that calls `Tensor.cuda()` or names CUDA outside those modules fails loudly
("Torch not compiled with CUDA enabled") instead of being rewritten silently: bridge it here, where it is made.

Every bridge records the Megatron call sites that reach it in a ledger (`cuda_hits()`): the
regression detector for Megatron upgrades, since a new entry means a new CUDA assumption on
the path a test exercised. The bridges patch private Megatron names, so an untested
megatron-core release is refused where they apply (CPU) and only warned about on CUDA,
where nothing is patched (`check_megatron_version`).

Nothing else in the package should call `torch.cuda`; ask `device()`, `dist_backend()` and the
capabilities of `accelerator` here (tests/megatron_backend/platform/test_platform_capabilities.py enforces it).
Usage, in this order::

    prepare_megatron_import()   # before the first `import megatron.core`
    info = bridge_cpu()         # before building models; no-op on CUDA
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
import warnings
from typing import Any

import torch

from megatron_rl import accelerator as _accelerator
from megatron_rl.accelerator import (
    CopyDone,
    PlatformInfo,
    accelerator_names,
    accelerator_rng_state,
    collective_device,
    current_accelerator_index,
    default_collective_backend,
    device,
    device_capability,
    dist_backend,
    empty_host,
    memory_allocated,
    platform_info,
    select_local_device,
    set_accelerator_rng_state,
    set_current_accelerator,
    synchronize,
    transformer_engine_available,
)
from megatron_rl.megatron_backend.platform.cpu_bridge import (
    DEVICE_LITERAL_MODULES,
    TYPE_CHECK_MODULES,
    CpuPlacedTorch,
    CpuTypeName,
)
from megatron_rl.megatron_backend.platform.cpu_bridge import apply as _apply_cpu_bridges
from megatron_rl.megatron_backend.platform.ledger import cuda_hits, format_cuda_hits
from megatron_rl.megatron_backend.platform.mcore_compat import (
    SUPPORTED_MCORE,
    check_megatron_version,
    checkpoint_writer_results_queue,
    dist_checkpoint_common_file,
    installed_megatron_version,
)

__all__ = [
    "DEVICE_LITERAL_MODULES",
    "KNOWN_BACKEND_WARNINGS",
    "SUPPORTED_MCORE",
    "TYPE_CHECK_MODULES",
    "CopyDone",
    "CpuPlacedTorch",
    "CpuTypeName",
    "PlatformInfo",
    "accelerator_names",
    "accelerator_rng_state",
    "bridge_cpu",
    "check_megatron_version",
    "checkpoint_writer_results_queue",
    "collective_device",
    "cuda_hits",
    "current_accelerator_index",
    "default_collective_backend",
    "device",
    "device_capability",
    "dist_backend",
    "dist_checkpoint_common_file",
    "empty_host",
    "format_cuda_hits",
    "installed_megatron_version",
    "memory_allocated",
    "platform_info",
    "prepare_megatron_import",
    "select_local_device",
    "set_accelerator_rng_state",
    "set_current_accelerator",
    "synchronize",
    "transformer_engine_available",
]

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


# Warnings Megatron-Core emits on every start where nothing is wrong: the optional GPU extras are absent (CPU, or a
# GPU install without apex: the torch fallbacks are what we use), a TransformerConfig default it deprecates itself,
# and torch's deprecation of the collective names Megatron calls. Anything else still shows.
# (category, message regex, module regex of the code that warns)
KNOWN_BACKEND_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\."),
    (UserWarning, r"Apex is not installed", r"megatron\."),
    (UserWarning, r"full scope is deprecated", r"megatron\."),
    # the optimizer's zero_grad reads .grad of its fp32 shard views (harmless: it only sets them to None)
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf", r"megatron\.core\.optimizer"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", r""),
)


def _filter_known_backend_warnings() -> None:
    for category, message, module in KNOWN_BACKEND_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def prepare_megatron_import(device_type: str | None = None) -> str:
    """Make `import megatron.core` possible; call before the first megatron import. Returns the version.

    megatron-core 0.19.x imports triton unconditionally (transformer/moe/ops/paged_stash.py,
    reached from megatron.core.__init__ through the pipeline schedules). Triton is ~1 GB and
    useless on CPU, so when it is absent a stub of that one module is registered. The stub
    exposes the module's names; its kernels are None, so the paged-stash feature fails
    loudly if anything tries to use it. Idempotent. `device_type` as in `check_megatron_version`.
    """
    _filter_known_backend_warnings()
    version = check_megatron_version(device_type=device_type)
    if (device_type or ("cpu" if _accelerator._on_cpu() else "cuda")) == "cpu":
        _eager_jit_fuser()
    if not version.startswith("0.19."):
        return version
    if _PAGED_STASH_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return version
    stub: Any = types.ModuleType(_PAGED_STASH_OPS)  # Any: ModuleType declares none of the names set below
    stub.__doc__ = "megatron_rl stub: triton is not installed (CPU); paged stash is unavailable."
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = None
    stub.paged_stash_pop_kernel = None
    sys.modules[_PAGED_STASH_OPS] = stub
    return version


_JIT = "megatron.core.jit"


def _noop_decorator(func: Any) -> Any:
    return func


def _eager_jit_fuser() -> None:
    """CPU: Megatron's `jit_fuser` (`megatron/core/jit.py`) is `torch.compile` on torch >= 2.2, applied at import
    to its fused GPU kernels (bias-GeLU/SwiGLU, the router's expert-bias count, ...): importing it loads inductor
    (~1.4 s of every process's start) and each decorated function is compiled with a C++ toolchain at its first
    call. Before Megatron is imported, register that module with the no-op Megatron itself falls back to
    (`noop_decorator`, what `disable_jit_fuser` sets), so those functions run eagerly, with the same math."""
    if _JIT in sys.modules or "megatron.core" in sys.modules:
        return
    stub: Any = types.ModuleType(_JIT)
    stub.__doc__ = "megatron_rl stub on CPU: jit_fuser is Megatron's noop_decorator (no torch.compile)."
    stub.noop_decorator = stub.jit_fuser = _noop_decorator
    stub.enable_jit_fuser = stub.disable_jit_fuser = lambda: None
    sys.modules[_JIT] = stub


_BRIDGE_LOCK = threading.Lock()


def bridge_cpu(enable: bool | None = None) -> PlatformInfo:
    """Make Megatron-Core run on this process's platform; idempotent.

    Args:
        enable: None (default) bridges exactly when CUDA is unavailable. False never
            bridges. True bridges even where CUDA exists (CPU runs on a GPU machine).

    On CUDA (or with enable=False) nothing is patched. On CPU this applies the bridges
    listed in the module docstring; none of them is a torch-function mode or a hook, so a
    forward, a backward or a `generate` call runs exactly as it would without them. The first
    call decides for the process: bridges cannot be removed once applied, and a later call
    whose explicit `enable` contradicts the first decision raises RuntimeError.
    """
    with _BRIDGE_LOCK:
        info = platform_info()
        if info is not None:
            if enable is False and info.bridges:
                raise RuntimeError("the CPU bridges are already applied in this process")
            if enable is True and not info.bridges:
                raise RuntimeError("this process already decided to run without the CPU bridges")
            return info
        if enable is None:
            enable = not torch.cuda.is_available()
        version = prepare_megatron_import(device_type="cpu" if enable else "cuda")
        if not enable:
            on_cuda = torch.cuda.is_available()
            return _accelerator._set_platform_info(
                PlatformInfo(
                    device="cuda" if on_cuda else "cpu",
                    backend="nccl" if on_cuda else "gloo",
                    mcore_version=version,
                )
            )
        bridges = tuple(_apply_cpu_bridges())
        return _accelerator._set_platform_info(
            PlatformInfo(device="cpu", backend="gloo", mcore_version=version, bridges=bridges)
        )
