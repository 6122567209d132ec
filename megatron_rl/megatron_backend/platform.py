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

Each bridge sits where the CUDA assumption is made, and none is a process-wide hook: there is
no torch-function mode, so a forward, a backward or a `transformers` generate call in the
same process pays nothing for the bridges (a TorchFunctionMode entered for the whole process
would cost ~0.36 s of a 0.54 s demo step). A Megatron path that calls `Tensor.cuda()` or
names CUDA outside those modules fails loudly ("Torch not compiled with CUDA enabled")
instead of being rewritten silently: bridge it here, where it is made.

Every bridge records the Megatron call sites that reach it in a ledger (`cuda_hits()`): the
regression detector for Megatron upgrades, since a new entry means a new CUDA assumption on
the path a test exercised. The bridges patch private Megatron names, so an untested
megatron-core release is refused where they apply (CPU) and only warned about on CUDA,
where nothing is patched (`check_megatron_version`).

Nothing else in the package should call `torch.cuda.is_available()`; ask `device()` and
`dist_backend()` here. Usage, in this order::

    prepare_megatron_import()   # before the first `import megatron.core`
    info = bridge_cpu()         # before building models; no-op on CUDA
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MCORE: tuple[str, ...] = ("0.16.", "0.19.")
"""Megatron-Core release lines this module was checked against (version prefixes)."""

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


@dataclass(frozen=True)
class PlatformInfo:
    """What `bridge_cpu()` decided for this process."""

    device: str
    """Where models and tensors live: "cuda" or "cpu"."""
    backend: str
    """torch.distributed backend: "nccl" on CUDA, "gloo" on CPU."""
    mcore_version: str
    """Installed megatron-core version."""
    bridges: tuple[str, ...] = ()
    """Names of the CPU bridges applied (empty on CUDA)."""


# --------------------------------------------------------------------------------------
# Version guard and import preparation
# --------------------------------------------------------------------------------------


def installed_megatron_version() -> str:
    """Return the installed megatron-core version without importing megatron."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            "megatron-core is not installed; supported versions: " + ", ".join(f"{p}x" for p in SUPPORTED_MCORE)
        ) from exc


def check_megatron_version(version: str | None = None, device_type: str | None = None) -> str:
    """Return the megatron-core version; refuse an untested release where the CPU bridges apply.

    The CPU bridges patch private Megatron functions whose names move between releases, so on
    ``device_type="cpu"`` an untested release raises instead of being patched blindly. On
    ``"cuda"`` nothing is patched: an untested release gets a warning and the run goes on.

    Args:
        version: the version to check (default: the installed one).
        device_type: "cpu" or "cuda" (default: this process's platform, see `device()`).
    """
    version = installed_megatron_version() if version is None else version
    if version.startswith(SUPPORTED_MCORE):
        return version
    if device_type is None:
        device_type = "cpu" if _on_cpu() else "cuda"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    tested = ", ".join(p + "x" for p in SUPPORTED_MCORE)
    if device_type == "cpu":
        raise RuntimeError(
            f"megatron-core {version} is installed, but the CPU bridges of megatron_rl support only {tested}. "
            "Add the new release to megatron_rl/megatron_backend/platform.py only after re-checking its CUDA "
            "assumptions (see cuda_hits())."
        )
    warnings.warn(
        f"megatron-core {version} is untested with megatron_rl (tested: {tested}); nothing is patched on CUDA, "
        "so the run goes on",
        UserWarning,
        stacklevel=2,
    )
    return version


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
    if (device_type or ("cpu" if _on_cpu() else "cuda")) == "cpu":
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


# --------------------------------------------------------------------------------------
# CUDA-hit ledger
# --------------------------------------------------------------------------------------

_LEDGER: dict[tuple[str, str], int] = {}
_LEDGER_LOCK = threading.Lock()
_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_megatron_dir_cache: str | None = None
_SITE_CACHE: dict[tuple[types.CodeType, int], str] = {}


def _megatron_dir() -> str:
    """The `megatron/` package directory, with a trailing separator (found without importing it)."""
    global _megatron_dir_cache
    if _megatron_dir_cache is None:
        spec = importlib.util.find_spec("megatron.core")
        locations = list(spec.submodule_search_locations or []) if spec else []
        core = os.path.abspath(locations[0]) if locations else ""
        _megatron_dir_cache = os.path.dirname(core) + os.sep if core else "\0"
    return _megatron_dir_cache


def _call_site() -> str:
    """The innermost megatron frame on the stack, as 'megatron/...py:LINE func'.

    Falls back to the innermost frame outside torch and this module, marked '(outside)'.
    The answer for a megatron caller is cached by its code location, so a bridge hit on a
    forward path costs a dictionary lookup, not a stack walk.
    """
    megatron_dir = _megatron_dir()
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == _THIS_FILE:
        frame = frame.f_back
    if frame is None:
        return "(unknown)"
    key = (frame.f_code, frame.f_lineno)
    site = _SITE_CACHE.get(key)
    if site is not None:
        return site
    strip = len(os.path.dirname(megatron_dir.rstrip(os.sep))) + 1
    caller_in_megatron = frame.f_code.co_filename.startswith(megatron_dir)
    outside = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(megatron_dir):
            site = f"{filename[strip:]}:{frame.f_lineno} {frame.f_code.co_name}"
            if caller_in_megatron:
                _SITE_CACHE[key] = site
            return site
        if outside is None and filename != _THIS_FILE and not filename.startswith(_TORCH_DIR):
            outside = f"(outside) {filename}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return outside or "(unknown)"


def _record(api: str) -> None:
    key = (api, _call_site())
    with _LEDGER_LOCK:
        _LEDGER[key] = _LEDGER.get(key, 0) + 1


def cuda_hits() -> dict[str, dict[str, int]]:
    """CUDA assumptions that fired since the bridges were applied.

    Returns ``{api: {call_site: hit_count}}`` in first-hit order, where ``call_site`` is
    the innermost megatron frame ('megatron/core/...py:LINE function').
    """
    out: dict[str, dict[str, int]] = {}
    with _LEDGER_LOCK:
        for (api, site), count in _LEDGER.items():
            out.setdefault(api, {})[site] = count
    return out


def format_cuda_hits() -> str:
    """The ledger as lines 'CUDA-HIT <api> x<count> <call site>'."""
    with _LEDGER_LOCK:
        items = list(_LEDGER.items())
    return "\n".join(f"CUDA-HIT {api} x{count} {site}" for (api, site), count in items)


# --------------------------------------------------------------------------------------
# torch.cuda stand-ins
# --------------------------------------------------------------------------------------


class _FakeEvent:
    """CPU stand-in for torch.cuda.Event: CPU work is synchronous, so events are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _FakeStream:
    """CPU stand-in for torch.cuda.Stream; usable as a context manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _FakeEvent:
        return event if event is not None else _FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_FAKE_STREAM = _FakeStream()


def _counted(api: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _record(api)
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", api.rsplit(".", 1)[-1])
    wrapper.__doc__ = f"megatron_rl CPU bridge for {api}."
    return wrapper


def _counted_class(api: str, cls: type) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _record(api)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cuda_replacements() -> dict[str, Any]:
    """torch.cuda attribute -> CPU stand-in."""
    cpu = torch.device("cpu")
    return {
        "current_device": lambda: cpu,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "set_device": lambda device: None,
        "device_count": lambda: 0,
        "current_stream": lambda device=None: _FAKE_STREAM,
        "default_stream": lambda device=None: _FAKE_STREAM,
        "Stream": _FakeStream,
        "Event": _FakeEvent,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "get_device_capability": lambda device=None: (0, 0),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": _cpu_manual_seed,
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: mapping it to
        # torch.manual_seed would recurse, and the CPU generator is already seeded.
        "manual_seed_all": lambda seed: None,
    }


def _bridge_torch_cuda() -> list[str]:
    names = []
    for attr, stand_in in _cuda_replacements().items():
        api = f"torch.cuda.{attr}"
        if isinstance(stand_in, type):
            setattr(torch.cuda, attr, _counted_class(api, stand_in))
        else:
            setattr(torch.cuda, attr, _counted(api, stand_in))
        names.append(api)
    for attr in ("range_push", "range_pop"):
        api = f"torch.cuda.nvtx.{attr}"
        setattr(torch.cuda.nvtx, attr, _counted(api, lambda *args, **kwargs: None))
        names.append(api)
    return names


# --------------------------------------------------------------------------------------
# device="cuda" literals: a CPU-placing `torch` namespace for the Megatron modules that write them
# --------------------------------------------------------------------------------------

DEVICE_LITERAL_MODULES: tuple[str, ...] = (
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.layer_wise_optimizer",  # 0.19.x
    "megatron.core.optimizer.optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.utils",
)
"""Megatron modules that create tensors with a hard-coded ``device="cuda"`` (grep of 0.16.1 and
0.19.2; the ledger shows which fire: schedules' token counters, the optimizer's scalars and
grad-norm buffers). A module a release does not have is skipped."""

_FACTORY_FUNCTIONS = frozenset(
    {"empty", "empty_like", "full", "full_like", "ones", "ones_like", "tensor", "zeros", "zeros_like"}
)


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)


def _cpu_placed(factory: Callable[..., Any]) -> Callable[..., Any]:
    def placed(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            _record(f"device={device!r}")
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    placed.__name__ = factory.__name__
    placed.__doc__ = f"megatron_rl CPU bridge: torch.{factory.__name__} with device='cuda' placed on the CPU."
    return placed


class CpuPlacedTorch(types.ModuleType):
    """The `torch` that the modules in `DEVICE_LITERAL_MODULES` see on CPU.

    It is torch, except that its tensor factories (`torch.zeros`, `torch.tensor`, ...) place a
    ``device=`` that names CUDA on the CPU and record the call site in the ledger. Every other
    attribute is torch's own object, cached on first use, so lookups cost what they cost on
    the real module and nothing outside those Megatron modules is touched.
    """

    def __init__(self) -> None:
        super().__init__("torch", "megatron_rl CPU bridge: torch with CUDA device literals placed on the CPU")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORY_FUNCTIONS:
            value = _cpu_placed(value)
        setattr(self, name, value)
        return value


def _bridge_device_literals() -> str:
    placed_torch = CpuPlacedTorch()
    for module_name in DEVICE_LITERAL_MODULES:
        if importlib.util.find_spec(module_name) is None:
            continue
        module: Any = importlib.import_module(module_name)  # Any: ModuleType declares no `torch`
        if getattr(module, "torch", None) is torch:
            module.torch = placed_torch
    return "megatron device='cuda' literals (CpuPlacedTorch)"


# --------------------------------------------------------------------------------------
# The optimizer's `Tensor.type() == "torch.cuda.FloatTensor"` checks
# --------------------------------------------------------------------------------------

TYPE_CHECK_MODULES: tuple[str, ...] = (
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.optimizer",
)
"""Megatron modules whose functions compare ``tensor.type()`` with CUDA type names."""

_CUDA_TYPE_NAMES = ("torch.cuda.FloatTensor", "torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor")


class CpuTypeName(str):
    """A CPU tensor type name ("torch.FloatTensor") standing where Megatron wrote the CUDA one.

    Comparing it records the call site as a "Tensor.type()" hit. Python asks a str subclass
    first, whichever side of ``==`` it is on, so ``param.type() == <this>`` lands here.
    """

    def __eq__(self, other: object) -> bool:
        _record("Tensor.type()")
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _names_cuda_type(const: Any) -> bool:
    if type(const) is str:
        return const in _CUDA_TYPE_NAMES
    if isinstance(const, (tuple, frozenset)):
        return any(_names_cuda_type(c) for c in const)
    if isinstance(const, types.CodeType):
        return any(_names_cuda_type(c) for c in const.co_consts)
    return False


def _cpu_type_constants(const: Any) -> Any:
    """`const` (a code object, or a constant in one) with every CUDA tensor type name replaced by
    its `CpuTypeName`, recursively through nested tuples and code objects."""
    if type(const) is str and const in _CUDA_TYPE_NAMES:
        return CpuTypeName("torch." + const[len("torch.cuda.") :])
    if isinstance(const, (tuple, frozenset)):
        return type(const)(_cpu_type_constants(c) for c in const)
    if isinstance(const, types.CodeType):
        return const.replace(co_consts=tuple(_cpu_type_constants(c) for c in const.co_consts))
    return const


def _functions_defined_in(module: types.ModuleType) -> list[types.FunctionType]:
    found = []
    for value in vars(module).values():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        members = vars(value).values() if isinstance(value, type) else (value,)
        for member in members:
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                found.append(member)
    return found


def _bridge_tensor_type_checks() -> str:
    """Rewrite, in the compiled code of Megatron's optimizer functions, the CUDA type names that
    ``Tensor.type()`` is compared with into the CPU names: the check then holds for CPU tensors
    at no cost per call (the process-wide torch-function mode this replaces intercepted every
    torch call to answer three string comparisons)."""
    for module_name in TYPE_CHECK_MODULES:
        rewritten = 0
        for function in _functions_defined_in(importlib.import_module(module_name)):
            if _names_cuda_type(function.__code__):
                function.__code__ = _cpu_type_constants(function.__code__)
                rewritten += 1
        if not rewritten:
            raise RuntimeError(
                f"{module_name} no longer compares Tensor.type() with a CUDA type name: re-check the CPU "
                "bridges in megatron_rl/megatron_backend/platform.py for this megatron-core release"
            )
    return "megatron optimizer Tensor.type() checks (CpuTypeName)"


# --------------------------------------------------------------------------------------
# Megatron function patches
# --------------------------------------------------------------------------------------


def _replace_everywhere(module_name: str, attr: str, new: Any) -> None:
    """Set module.attr = new, and rebind every megatron module that imported the original."""
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, new)
    for name, other in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(other, attr, None) is original:
            setattr(other, attr, new)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    _record("get_default_causal_mask")
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _patch_causal_mask() -> str:
    # The original builds the mask with device="cuda" (transformer/utils.py).
    _replace_everywhere("megatron.core.transformer.utils", "get_default_causal_mask", _cpu_causal_mask)
    return "megatron.transformer.utils.get_default_causal_mask"


def _cpu_sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    _record("get_sliding_window_causal_mask")
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def _patch_sliding_window_mask() -> str:
    # The original builds the mask with device="cuda" (transformer/utils.py; sliding-window attention, GPT-OSS).
    _replace_everywhere("megatron.core.transformer.utils", "get_sliding_window_causal_mask", _cpu_sliding_window_mask)
    return "megatron.transformer.utils.get_sliding_window_causal_mask"


def _patch_te_general_gemm() -> str | None:
    # 0.16.x: RouterGatingLinearFunction reads the module global `te_general_gemm`, which
    # only exists when Transformer Engine imports (NameError otherwise).
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return None
    moe_utils.te_general_gemm = None
    return "megatron.moe_utils.te_general_gemm=None"


def _patch_norm_sequence_parallel() -> str:
    # The local spec's WrappedTorchNorm asserts `not config.sequence_parallel`, but MoE with
    # TP > 1 requires sequence parallelism (moe_layer.py raises otherwise). Build the norm
    # from a copy of the config without the flag, then tag its parameters so that
    # finalize_model_grads all-reduces their gradients over the TP group, as it does for
    # every other sequence-parallel norm.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__

    def __new__(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, *args, **kwargs)
        _record("WrappedTorchNorm(sequence_parallel=True)")
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)
    return "megatron.WrappedTorchNorm.sequence_parallel"


def _patch_split_sizes_to_numpy() -> str:
    # The alltoall dispatcher converts split sizes to numpy only `if tensor.is_cuda`; on
    # CPU they stay tensors and all_to_all_single(output_split_sizes=<Tensor>) TypeErrors.
    from megatron.core.transformer.moe import moe_utils

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            _record("maybe_move_tensor_to_cpu(as_numpy)")
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _replace_everywhere("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    return "megatron.moe_utils.maybe_move_tensor_to_cpu"


def _patch_rng_state() -> str:
    # The model-parallel RNG tracker (model_parallel_cuda_manual_seed, fork) saves and
    # restores the CUDA generator; on CPU the CPU generator plays that role.
    # Extra arguments (device, clone, graph_safe, ...) only matter for CUDA generators.
    def _get_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        _record("_get_cuda_rng_state")
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        _record("_set_cuda_rng_state")
        torch.set_rng_state(new_state)

    module = "megatron.core.tensor_parallel.random"
    _replace_everywhere(module, "_get_cuda_rng_state", _get_cuda_rng_state)
    _replace_everywhere(module, "_set_cuda_rng_state", _set_cuda_rng_state)
    return "megatron.tensor_parallel.random._get/_set_cuda_rng_state"


def _patch_one_rank_buffer_collectives() -> str:
    # DDP reduce-scatters the gradient buffers and the distributed optimizer all-gathers the parameter buffers in
    # place (a rank's shard is a view of the buffer). Over a group of one rank both are the identity: NCCL moves
    # no data for them, gloo copies the whole buffer onto itself (0.2 s each for the 180 MB of a 45 M-parameter
    # fp32 model on this 2-core machine, every update). Such a call returns at once here; any other, and every
    # asynchronous one, is torch's.
    from megatron.core.distributed import param_and_grad_buffer as buffers

    def identity_on_one_rank(collective: Callable[..., Any]) -> Callable[..., Any]:
        def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            in_place = output.data_ptr() == input.data_ptr() and output.numel() == input.numel()
            one_rank = torch.distributed.get_world_size(kwargs.get("group")) == 1
            if in_place and one_rank and not kwargs.get("async_op", False):
                return None
            return collective(output, input, *args, **kwargs)

        return call

    buffers.dist_all_gather_func = identity_on_one_rank(buffers.dist_all_gather_func)
    buffers.dist_reduce_scatter_func = identity_on_one_rank(buffers.dist_reduce_scatter_func)
    return "megatron.param_and_grad_buffer one-rank in-place reduce-scatter/all-gather"


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------

_INFO: PlatformInfo | None = None
_BRIDGE_LOCK = threading.Lock()
_TE_AVAILABLE: bool | None = None


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
    global _INFO
    with _BRIDGE_LOCK:
        if _INFO is not None:
            if enable is False and _INFO.bridges:
                raise RuntimeError("the CPU bridges are already applied in this process")
            if enable is True and not _INFO.bridges:
                raise RuntimeError("this process already decided to run without the CPU bridges")
            return _INFO
        if enable is None:
            enable = not torch.cuda.is_available()
        version = prepare_megatron_import(device_type="cpu" if enable else "cuda")
        if not enable:
            on_cuda = torch.cuda.is_available()
            _INFO = PlatformInfo(
                device="cuda" if on_cuda else "cpu",
                backend="nccl" if on_cuda else "gloo",
                mcore_version=version,
            )
            return _INFO

        import megatron.core  # noqa: F401  (the patches below rebind names it imported)

        bridges = _bridge_torch_cuda()
        bridges.append(_patch_causal_mask())
        bridges.append(_patch_sliding_window_mask())
        te_gemm = _patch_te_general_gemm()
        if te_gemm is not None:
            bridges.append(te_gemm)
        bridges.append(_patch_norm_sequence_parallel())
        bridges.append(_patch_split_sizes_to_numpy())
        bridges.append(_patch_rng_state())
        bridges.append(_patch_one_rank_buffer_collectives())
        bridges.append(_bridge_device_literals())
        bridges.append(_bridge_tensor_type_checks())
        _INFO = PlatformInfo(device="cpu", backend="gloo", mcore_version=version, bridges=tuple(bridges))
        return _INFO


def platform_info() -> PlatformInfo | None:
    """What `bridge_cpu()` decided, or None before it ran."""
    return _INFO


def _on_cpu() -> bool:
    if _INFO is not None:
        return _INFO.device == "cpu"
    return not torch.cuda.is_available()


def device() -> torch.device:
    """The device models and batches live on: the current CUDA device, or the CPU."""
    if _on_cpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def dist_backend() -> str:
    """torch.distributed backend for this platform: "nccl" on CUDA, "gloo" on CPU."""
    return "gloo" if _on_cpu() else "nccl"


def transformer_engine_available() -> bool:
    """Whether Transformer Engine's PyTorch extension imports (never on a CPU-only torch)."""
    global _TE_AVAILABLE
    if _TE_AVAILABLE is None:
        if importlib.util.find_spec("transformer_engine") is None:
            _TE_AVAILABLE = False
        else:
            try:
                importlib.import_module("transformer_engine.pytorch")
                _TE_AVAILABLE = True
            except Exception:  # noqa: BLE001 - a broken TE build is "not available", whatever it raises
                _TE_AVAILABLE = False
    return _TE_AVAILABLE


def dist_checkpoint_common_file() -> str | None:
    """The file a Megatron dist checkpoint keeps its non-tensor state in, next to torch DCP's files: "common.pt"
    in 0.16.x; None in 0.19.x, where torch DCP holds that state itself (save_common/load_common are deprecated)."""
    return None if check_megatron_version().startswith("0.19.") else "common.pt"


def checkpoint_writer_results_queue() -> Any:
    """The results queue of Megatron's checkpoint writer, created on first use: a spawned multiprocessing Manager
    process that lives as long as this process (`_get_write_results_queue` in 0.16.x, `get_write_results_queue`
    in 0.19.x; megatron/core/dist_checkpointing/strategies/filesystem_async.py)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    get_queue = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
    return get_queue()


def select_local_device(local_rank: int) -> torch.device:
    """Bind this process to its local accelerator (torchrun LOCAL_RANK); CPU: no-op."""
    if not _on_cpu():
        torch.cuda.set_device(local_rank)
    return device()
