"""Costly results built once per pytest session and shared by every test process: the warmed-up demo model
(with the `train` checkpoint of the run that warmed it up) and the actor checkpoints of
tests/megatron_backend/checkpoint/scripts/checkpoint_check.py.

With pytest-xdist each worker is a process of its own with a temporary folder under one folder of the session;
the first worker that asks builds the result there under a file lock, the others wait for it and reuse it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock  # a dependency of torch

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.dist_harness import run_torchrun

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny_moe_gspo.yaml"
TRAIN = [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE)]
DEMO_SEED = 1234  # the random demo model the loop tests start from
# The supervised warm-up of the loop tests (a short version of the demo's): the shared warmed-up model is this.
DEMO_WARMUP = ("warmup.sft_steps=150", "warmup.sft_batch_size=32", "warmup.sft_lr=2e-3")


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every process of this session sees (a worker's own base folder lies under it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`session_dir/name`, built by `build(folder)` unless a process of this session has built it already. The
    build writes elsewhere and is renamed into place, so a failed one leaves nothing that looks done."""
    root = session_dir(tmp_path_factory)
    done = root / name
    with FileLock(root / f"{name}.lock"):
        if not done.is_dir():
            staging = root / f"{name}.building"
            shutil.rmtree(staging, ignore_errors=True)
            build(staging)
            staging.rename(done)
    return done


@dataclass(frozen=True)
class WarmedModel:
    initial: Path  # the random demo model (seed DEMO_SEED)
    warmed: Path  # the same after the loop's supervised warm-up (DEMO_WARMUP), in HF format
    run: Path  # the `train` run that warmed it up: checkpoints/ holds step 1, one RL step after the warm-up


def build_warmed_demo_model(folder: Path) -> None:
    """`megatron-rl train` runs the warm-up (and one RL step: trainer.steps is at least 1); the warm-up's model
    is what the loop saves as `warmup_model`."""
    initial = make_tiny_qwen3_moe(folder / "initial", seed=DEMO_SEED)
    run = folder / "run"
    proc = subprocess.run(
        [*TRAIN, f"trainer.output_dir={run}", f"model.hf_path={initial}", *DEMO_WARMUP, "trainer.steps=1",
         "data.eval=null", "data.eval_every=0", "trainer.save_every=0", "logging.wandb=false", "logging.plot=false"],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (run / "warmup_model" / "config.json").is_file()


def warmed_demo_model(tmp_path_factory: pytest.TempPathFactory) -> WarmedModel:
    folder = build_once(tmp_path_factory, "warmed_demo_model", build_warmed_demo_model)
    return WarmedModel(folder / "initial", folder / "run" / "warmup_model", folder / "run")


CHECKPOINT_SCRIPT = Path(__file__).parent / "megatron_backend" / "checkpoint" / "scripts" / "checkpoint_check.py"


def checkpoint_phase(
    model: Path, ckpt: Path, out: Path, phase: str, nproc: int = 1, extra: tuple[str, ...] = ()
) -> dict:
    """One phase of checkpoint_check.py under torchrun; the JSON it writes."""
    run_torchrun(
        CHECKPOINT_SCRIPT,
        nproc,
        ["--model", str(model), "--ckpt", str(ckpt), "--out", str(out), "--phase", phase, *extra],
    )
    return json.loads(out.read_text())


@dataclass(frozen=True)
class ActorCheckpoint:
    ckpt: Path  # checkpoint_check.py's checkpoint folder: step 2 of its run, `latest` names it
    full: dict  # what its full phase wrote: the metrics of steps 3-4 after the save


def actor_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, model: Path, nproc: int, extra: tuple[str, ...]
) -> ActorCheckpoint:
    """checkpoint_check.py's full phase on `model` in one layout, once per session. Shared read-only: a test that
    writes into the checkpoint works on a copy. `model` is a session fixture built alike in every worker, so the
    layout names the result."""

    def build(folder: Path) -> None:
        folder.mkdir(parents=True)
        checkpoint_phase(model, folder / "ckpt", folder / "full.json", "full", nproc, extra)

    folder = build_once(tmp_path_factory, "actor_checkpoint_" + "_".join(["np", str(nproc), *extra]), build)
    return ActorCheckpoint(folder / "ckpt", json.loads((folder / "full.json").read_text()))
