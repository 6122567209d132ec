"""Fixtures of the rollout tests: a tiny random Qwen3-MoE (default spec), its tokenizer and an engine on it, and
the check that the python tool's kernel isolation (bubblewrap) can run here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.tiny_model import build_char_tokenizer, make_tiny_qwen3_moe


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_default"), seed=0)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LocalEngine:
    """Shared by a test module's read-only tests (tests that change weights build their own)."""
    return LocalEngine(tiny_dir)


@pytest.fixture(scope="session")
def kernel_isolation() -> None:
    """Skips a test of the python tool where bubblewrap cannot make a sandbox; fails it under CI=true (.ci/run
    installs bubblewrap)."""
    from megatron_rl.rollout.agent.tools.isolation import IsolationUnavailable, probe

    try:
        probe("bwrap", sys.executable)
    except IsolationUnavailable as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the python tool's tests (.ci/run installs bubblewrap): {err}")
        pytest.skip(str(err))
