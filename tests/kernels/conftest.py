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
TRITON_GSPO_MODULE = "megatron_rl.kernels.triton_gspo"


def triton_mode() -> str:
    """How Triton kernels run in this process: ``compiled`` (CUDA) or ``interpreter`` (CPU)."""
    return "compiled" if DEVICE.type == "cuda" else "interpreter"


def _triton_module(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton) - Triton kernel tests skipped")
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = sys.modules.get(name)
    return importlib.import_module(name) if module is None else module


@pytest.fixture
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``megatron_rl.kernels.triton_logprob``; skips when triton is not installed."""
    yield _triton_module(TRITON_MODULE, monkeypatch)


@pytest.fixture
def triton_gspo(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``megatron_rl.kernels.triton_gspo`` (what ``packed_gspo_loss(impl="triton")`` runs); skips without triton."""
    yield _triton_module(TRITON_GSPO_MODULE, monkeypatch)
