"""Megatron distributed checkpoints: exact resume, crash during save, layout-independent model weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.megatron.dist_harness import TorchrunError
from tests.shared_runs import checkpoint_phase

pytestmark = pytest.mark.torchrun


# The single process resumes exactly in tests/trainer (the whole loop) too: the slow tier.
@pytest.mark.parametrize(
    ("nproc", "extra"),
    [
        pytest.param(1, (), id="single", marks=pytest.mark.slow),
        pytest.param(2, (), id="dp2"),
        pytest.param(2, ("--ep", "2"), id="ep2"),
    ],
)
def test_resume_continues_exactly(
    tiny_moe_dir: Path, trained_actor_checkpoint, tmp_path: Path, nproc: int, extra: tuple[str, ...]
) -> None:
    """Steps 3-4 after resuming from the step-2 checkpoint equal steps 3-4 of the uninterrupted run.

    Covers model, optimizer moments and Adam's step count, the cosine LR schedule and the RNG that
    draws the advantages."""
    shared = trained_actor_checkpoint(nproc, extra)  # the resume only reads the checkpoint
    full = shared.full
    resumed = checkpoint_phase(tiny_moe_dir, shared.ckpt, tmp_path / "resume.json", "resume", nproc, extra)
    assert resumed["trainer_state"] == {"data_position": 2}
    assert resumed["steps"] == full["steps"]
    assert full["steps"][0]["loss"] != full["steps"][1]["loss"]


def test_crash_during_save_keeps_previous_checkpoint(tiny_moe_dir: Path, trained_actor_checkpoint, tmp_path: Path):
    shared = trained_actor_checkpoint()
    ckpt, full = shutil.copytree(shared.ckpt, tmp_path / "ckpt"), shared.full  # the crash writes into it
    with pytest.raises(TorchrunError):
        checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "crash.json", "crash")
    assert (ckpt / "latest").read_text() == "step_000000002"
    assert any(p.name.startswith(".tmp_step_000000003") for p in ckpt.iterdir()), "the interrupted save left no trace"
    assert not (ckpt / "step_000000003").exists()
    # The previous checkpoint still resumes exactly.
    resumed = checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "resume.json", "resume")
    assert resumed["steps"] == full["steps"]


def test_model_weights_load_into_any_layout(tiny_moe_dir: Path, trained_actor_checkpoint, tmp_path: Path) -> None:
    ckpt = trained_actor_checkpoint().ckpt
    ref = checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "score1.json", "score")["log_probs"]
    for extra in (("--tp", "2"), ("--ep", "2"), ("--pp", "2")):
        got = checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "score2.json", "score", 2, extra)["log_probs"]
        worst = max(abs(a - b) for ra, rb in zip(got, ref, strict=True) for a, b in zip(ra, rb, strict=True))
        assert worst < 5e-6, f"{extra}: {worst}"
