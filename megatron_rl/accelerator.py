"""Device capabilities asked of one place: where tensors live, pinned host memory, the accelerator's RNG, memory
counters, synchronisation and the device a collective backend works on.

On a GPU each function makes the `torch.cuda` call the code made before it was gathered here; on the CPU it does
what the CPU path did (nothing to pin, to synchronise or to count).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch


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


_INFO: PlatformInfo | None = None
_TE_AVAILABLE: bool | None = None


def platform_info() -> PlatformInfo | None:
    """What `bridge_cpu()` decided, or None before it ran."""
    return _INFO


def _set_platform_info(info: PlatformInfo) -> PlatformInfo:
    global _INFO
    _INFO = info
    return info


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


def select_local_device(local_rank: int) -> torch.device:
    """Bind this process to its local accelerator (torchrun LOCAL_RANK); CPU: no-op."""
    if not _on_cpu():
        torch.cuda.set_device(local_rank)
    return device()


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


def default_collective_backend() -> str:
    """The backend a process group of its own takes when none is configured: "nccl" where CUDA exists, else "gloo"
    (asked of the machine, not of `bridge_cpu()`'s decision: the group may live in a process that never bridges)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def collective_device(backend: str) -> torch.device:
    """The device the tensors of a `backend` collective live on: the current CUDA device for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def empty_host(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor, in page-locked memory if `pinned` and this torch can pin (a CUDA build with a
    GPU), so that copies from the GPU into it can run asynchronously; plain host memory otherwise."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned and torch.cuda.is_available())


def accelerator_rng_state() -> torch.Tensor | None:
    """The current accelerator's RNG state (`torch.cuda.get_rng_state()`), or None on the CPU (whose generator is
    `torch.get_rng_state()`'s)."""
    return torch.cuda.get_rng_state() if device().type == "cuda" else None


def set_accelerator_rng_state(state: torch.Tensor | None) -> None:
    """Restore a state from `accelerator_rng_state()` on the current accelerator; no-op on the CPU or for None."""
    if state is not None and device().type == "cuda":
        torch.cuda.set_rng_state(state)


def memory_allocated(at: torch.device) -> int | None:
    """Bytes the caching allocator holds in tensors on `at` (`torch.cuda.memory_allocated`); None for a device
    without such a counter (the CPU: host memory is shared by every process on the machine)."""
    return torch.cuda.memory_allocated(at) if at.type == "cuda" else None


def synchronize() -> None:
    """Wait for the current accelerator's queued work (`torch.cuda.synchronize()`); CPU work is already done."""
    if device().type == "cuda":
        torch.cuda.synchronize()


def device_capability(at: torch.device) -> tuple[int, int]:
    """The compute capability of CUDA device `at` (e.g. (8, 0) for an A100); (0, 0) for a device that has none."""
    return torch.cuda.get_device_capability(at) if at.type == "cuda" else (0, 0)


def accelerator_names() -> list[str]:
    """The names of this machine's CUDA devices (empty without one)."""
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


class CopyDone:
    """Marks the point in the current stream's queue reached so far, so that a later `wait` blocks until the
    device-to-host copies queued before it have landed (a `torch.cuda.Event`); use only where CUDA work was
    queued."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> None:
        """Block until the work queued before this mark has run."""
        self._event.synchronize()


def current_accelerator_index() -> int | None:
    """The index of this thread's current CUDA device once CUDA is initialised in this process, else None."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def set_current_accelerator(index: int) -> None:
    """Make CUDA device `index` this thread's current device (a new thread starts on device 0)."""
    torch.cuda.set_device(index)
