"""Whether Triton is installed; the kernels' dispatchers choose Triton for CUDA tensors only when it is."""

from __future__ import annotations

import importlib.util

__all__ = ["triton_available"]


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (its kernels may still need a GPU or the interpreter)."""
    return importlib.util.find_spec("triton") is not None
