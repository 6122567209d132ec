"""Fixtures of the rollout tests: a tiny random Qwen3-MoE (default spec), its tokenizer and an engine on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.rollout.local_engine import LocalEngine
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
