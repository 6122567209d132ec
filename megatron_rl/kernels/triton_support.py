"""Whether Triton can run a kernel here, and the one rule every ``impl="auto"`` follows (`triton_preferred`)."""

from __future__ import annotations

import importlib.util
import os

from torch import Tensor

__all__ = ["check_triton_can_run", "triton_available", "triton_preferred"]


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (its kernels may still need a GPU or the interpreter)."""
    return importlib.util.find_spec("triton") is not None


def triton_preferred(tensor: Tensor) -> bool:
    """Whether ``impl="auto"`` takes Triton for ``tensor``: a CUDA tensor and triton installed. Off CUDA the
    interpreter would run, far slower than torch, so auto falls back to the caller's plain-torch path there."""
    return tensor.is_cuda and triton_available()


def check_triton_can_run(tensor: Tensor, what: str) -> None:
    """Raise a clear error where a Triton kernel cannot run on ``tensor``: triton missing, or CPU tensors without
    the interpreter (``TRITON_INTERPRET=1``, read by triton itself when the kernel modules are imported)."""
    if not triton_available():
        raise RuntimeError(f"{what}: impl='triton' needs the triton package (pip install 'megatron-rl[gpu]')")
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{what}: impl='triton' got {tensor.device.type} tensors; Triton compiles for GPUs only, and runs on CPU "
            "in its interpreter when TRITON_INTERPRET=1 is set before the kernels are imported. Use the torch "
            "implementation on CPU, or set TRITON_INTERPRET=1 to test the kernel"
        )
