"""Fixtures of the real-SGLang tier: a CPU SGLang 0.5.23 server (lean venv + test shims) serving a tiny Qwen3-MoE.

Run: `bash scripts/install_sglang_cpu.sh && pytest -m sglang tests/sglang`. Skipped when the venv is absent.
The SGLang Python is `$MEGATRON_RL_SGLANG_PYTHON`, else `.venv-sglang/bin/python` in the repository.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from sglang_cpu_support import sglang_python

from megatron_rl.tiny_model import make_tiny_qwen3_moe

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sglang: needs the SGLang CPU venv (scripts/install_sglang_cpu.sh)")


@pytest.fixture(scope="session")
def sglang_py() -> str:
    python = sglang_python()
    if python is None:
        pytest.skip("SGLang venv absent: run `bash scripts/install_sglang_cpu.sh` (or set MEGATRON_RL_SGLANG_PYTHON)")
    probe = subprocess.run([python, "-c", "import sglang"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"sglang is not importable from {python}: {probe.stderr.strip()[-300:]}")
    return python


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model "a" (served at start) and three other random weight sets of the same architecture."""
    return {
        name: make_tiny_qwen3_moe(tmp_path_factory.mktemp(f"sgl_{name}"), seed=seed)
        for seed, name in enumerate(["a", "b", "c", "d"])
    }
