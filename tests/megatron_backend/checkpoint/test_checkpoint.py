"""Megatron distributed checkpoints: exact resume, crash during save, layout-independent model weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.dist_harness import TorchrunError, run_torchrun
from tests.shared_runs import checkpoint_phase

ASYNC_SCRIPT = Path(__file__).parent / "scripts" / "async_checkpoint_check.py"

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


@pytest.mark.same_on_every_megatron  # our writer's atomic rename: no Megatron call differs
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


@pytest.mark.same_on_every_megatron  # our background writer's ordering (the save is test_resume_continues_exactly's)
def test_background_save_waits_for_the_previous_and_resumes_exactly(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """Two data-parallel ranks save steps 1, 2 and 3 in the background while training goes on: a background save is
    published by its writer thread once both ranks have written it (at once or later, never half), the next save
    waits for it, and each checkpoint holds its own step (the in-place updates made while it was written are not in
    it; step 3's save is planned in the writer thread); step 3 after loading step 2 equals step 3 of the
    uninterrupted run (model, optimizer, LR schedule and RNG)."""
    out = tmp_path / "async.json"
    run_torchrun(ASYNC_SCRIPT, 2, ["--model", str(tiny_moe_dir), "--ckpt", str(tmp_path / "ckpt"), "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["after_save1"] in ({"latest": None, "complete": []}, {"latest": "step_000000001", "complete": [1]})
    assert got["after_save2"] == {"latest": "step_000000001", "complete": [1], "published": 1}
    assert got["waited"] == 2
    assert got["after_wait"] == {"latest": "step_000000002", "complete": [1, 2]}
    assert got["step1_log_probs"] != got["step2_log_probs"]
    assert got["loaded1_log_probs"] == got["step1_log_probs"]
    assert got["waited3"] == 3
    assert got["loaded3_log_probs"] == got["step3_log_probs"]
    assert got["loaded2_log_probs"] == got["step2_log_probs"]
    assert got["loaded2_state"] == {"data_position": 2}
    assert got["resumed_step3"] == got["full_step3"]
