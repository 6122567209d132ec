"""Fixtures for kernel tests: the Triton module, compiled on CUDA or under ``TRITON_INTERPRET=1`` on CPU.

``TRITON_INTERPRET`` is read when ``@triton.jit`` runs (module import) and again by triton's lazily imported
modules at launch, so the variable is set only while a Triton test runs (``monkeypatch``); other test files in
the same pytest process never see it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_MODULE = "megatron_rl.kernels.triton_logprob"


def triton_mode() -> str:
    """How Triton kernels run in this process: ``compiled`` (CUDA) or ``interpreter`` (CPU)."""
    return "compiled" if DEVICE.type == "cuda" else "interpreter"


@pytest.fixture
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``megatron_rl.kernels.triton_logprob``; skips when triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton) - Triton kernel tests skipped")
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = sys.modules.get(TRITON_MODULE)
    if module is None:
        module = importlib.import_module(TRITON_MODULE)
    yield module
