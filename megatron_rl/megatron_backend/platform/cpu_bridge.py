"""The CPU bridge: Megatron-Core's CUDA assumptions mapped onto the CPU, and the ledger of those that fired.

`apply()` is what `platform.bridge_cpu()` runs where no GPU is used; the package docstring lists the bridges.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl.megatron_backend.platform.ledger import record

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
        record(api)
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", api.rsplit(".", 1)[-1])
    wrapper.__doc__ = f"megatron_rl CPU bridge for {api}."
    return wrapper


def _counted_class(api: str, cls: type) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        record(api)

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
            record(f"device={device!r}")
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
        record("Tensor.type()")
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
                "bridges in megatron_rl/megatron_backend/platform/cpu_bridge.py for this megatron-core release"
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
    record("get_default_causal_mask")
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _patch_causal_mask() -> str:
    # The original builds the mask with device="cuda" (transformer/utils.py).
    _replace_everywhere("megatron.core.transformer.utils", "get_default_causal_mask", _cpu_causal_mask)
    return "megatron.transformer.utils.get_default_causal_mask"


def _cpu_sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    record("get_sliding_window_causal_mask")
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
        record("WrappedTorchNorm(sequence_parallel=True)")
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
            record("maybe_move_tensor_to_cpu(as_numpy)")
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _replace_everywhere("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    return "megatron.moe_utils.maybe_move_tensor_to_cpu"


def _patch_rng_state() -> str:
    # The model-parallel RNG tracker (model_parallel_cuda_manual_seed, fork) saves and
    # restores the CUDA generator; on CPU the CPU generator plays that role.
    # Extra arguments (device, clone, graph_safe, ...) only matter for CUDA generators.
    def _get_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        record("_get_cuda_rng_state")
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        record("_set_cuda_rng_state")
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


def apply() -> list[str]:
    """Apply every CPU bridge (`import megatron.core` first); returns their names. Call once per process."""
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
    return bridges
