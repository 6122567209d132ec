"""Shared fixtures: tiny MoE checkpoints built locally (no downloads), the warmed-up demo model and its run."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU. Triton reads this when it is first imported, and
    # other tests (transformers models, Megatron) may import it before tests/kernels runs, so set it here.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe
from tests import shared_runs
from tests.models.tiny_moe_decoders import make_tiny_mixtral, make_tiny_qwen2_moe

# One intra-op thread per test process (subprocesses inherit it; torchrun ranks get it from the harness): the tiny
# models' ops take microseconds, where a second OpenMP thread costs more than it saves and stalls for milliseconds
# whenever the other core is busy (a torchrun rank, a server, another test's subprocess).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# 4 layers with one dense layer (so PP=2 x VPP=2 has one layer per chunk), untied embeddings.
MIXED_SPEC = TinyQwen3MoeSpec(num_hidden_layers=4, mlp_only_layers=(1,), vocab_size=128)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe"), MIXED_SPEC, seed=0)


@pytest.fixture(scope="session")
def tiny_moe_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Further random configs: tied embeddings, norm_topk_prob off, decoder_sparse_step 2, GQA 4:1."""
    specs = {
        "tied_no_norm_topk": TinyQwen3MoeSpec(tie_word_embeddings=True, norm_topk_prob=False, num_hidden_layers=2),
        "sparse_step2": TinyQwen3MoeSpec(decoder_sparse_step=2, num_hidden_layers=4, num_experts=4),
        "gqa4_top4": TinyQwen3MoeSpec(num_attention_heads=8, num_key_value_heads=2, head_dim=8, num_experts_per_tok=4),
    }
    return {
        name: make_tiny_qwen3_moe(tmp_path_factory.mktemp(name), spec, seed=i + 1)
        for i, (name, spec) in enumerate(specs.items())
    }


@pytest.fixture(scope="session")
def other_families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints of the other supported families."""
    return {
        "qwen2_moe": make_tiny_qwen2_moe(tmp_path_factory.mktemp("qwen2_moe"), seed=5),
        "qwen2_moe_tied": make_tiny_qwen2_moe(
            tmp_path_factory.mktemp("qwen2_moe_tied"), seed=6, tie_word_embeddings=True
        ),
        "mixtral": make_tiny_mixtral(tmp_path_factory.mktemp("mixtral"), seed=7),
    }


@pytest.fixture(scope="session")
def warmed_demo(tmp_path_factory: pytest.TempPathFactory) -> shared_runs.WarmedModel:
    """The demo model after the loop tests' supervised warm-up, and the run that warmed it up (its checkpoint of
    one RL step after the warm-up); built once per session, for every worker."""
    return shared_runs.warmed_demo_model(tmp_path_factory)


@pytest.fixture(scope="session")
def trained_actor_checkpoint(
    tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., shared_runs.ActorCheckpoint]:
    """`(nproc, extra) -> ActorCheckpoint`: checkpoint_check.py's full phase on tiny_moe_dir in that layout (e.g.
    `(2, ("--ep", "2"))`), built once per session, for every worker."""
    return lambda nproc=1, extra=(): shared_runs.actor_checkpoint(tmp_path_factory, tiny_moe_dir, nproc, tuple(extra))
