"""Verified weight syncs on the tiny demo with the local engine: healthy syncs pass the probe (their |dlogp| is
logged), and a sync after which the engine computes with one perturbed expert (one the probe's tokens are routed
to) stops the run with the message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.megatron_backend.distributed import free_port
from tests.trainer.test_train_loop import EXAMPLE, FAST, NO_WARMUP, _history, model_dir  # noqa: F401 - a fixture

PERTURBING = Path(__file__).parent / "scripts" / "train_with_perturbed_expert.py"
SMALL = ("trainer.steps=3", "data.eval=null", "data.eval_every=0", "trainer.save_every=0", "logging.plot=false",
         "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.sampling.max_new_tokens=8")  # fmt: skip


def test_a_sync_whose_engine_computes_with_a_perturbed_expert_stops_the_run(
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out, perturbed = tmp_path / "run", tmp_path / "perturbed.json"
    proc = subprocess.run(
        [sys.executable, str(PERTURBING), "train", str(EXAMPLE), f"trainer.output_dir={out}",
         f"model.hf_path={model_dir}", *FAST, NO_WARMUP, *SMALL, "rollout.verify_sync_every=1"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PERTURB_AT": "step-2", "PERTURBED": str(perturbed)},
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-3000:]
    record = json.loads(perturbed.read_text())
    assert record["version"] == "step-2" and record["routed_tokens"] > 0  # the probe really uses that expert
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (message,) = [line for line in proc.stderr.splitlines() if line.startswith("megatron-rl train: stopped: ")]
    assert "weight sync to version 'step-2' did not take effect on local engine" in message
    for part in ("max |dlogp| = ", "mean ", "tolerance for float32: max 0.001", "re-lays out", "missed", "TP/EP"):
        assert part in message, part
    # Steps 1 (its own sync and the first, after start-up) were verified healthy and logged; step 2 stopped.
    history = _history(out)
    assert [r["step"] for r in history] == [1]
    assert 0 <= history[0]["sync/probe_logp_diff_max"] < 1e-4
    assert history[0]["time/sync_probe"] > 0


@pytest.mark.torchrun
def test_under_torchrun_every_rank_stops_with_the_message(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """TP=2: rank 0 holds the engine and compares, and broadcasts the verdict; the run stops with the message and
    does not hang (rank 1 prints it too unless torchrun ends it first, once rank 0 has exited)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(PERTURBING),
        "train",
        str(EXAMPLE),
        f"trainer.output_dir={tmp_path}",
        f"model.hf_path={model_dir}",
        *FAST,
        NO_WARMUP,
        *SMALL,
        "rollout.verify_sync_every=1",
        "parallel.tp=2",
    ]
    env = {**os.environ, "PERTURB_AT": "step-2", "PERTURBED": str(tmp_path / "p.json"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    stopped = [line for line in proc.stderr.splitlines() if line.startswith("megatron-rl train: stopped: ")]
    assert proc.returncode != 0 and 1 <= len(stopped) <= 2, proc.stderr[-3000:]
    assert all("weight sync to version 'step-2' did not take effect on local engine" in line for line in stopped)
