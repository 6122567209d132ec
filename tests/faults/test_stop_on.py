"""`trainer.stop_on` end to end: a real R3 run whose thresholds are set past its healthy values. Every update's
grad norm is above the skip threshold (skipped and counted, the weights untouched), and the route agreement
(at most 1) is below 1.01, so the run stops after step 1 with one line naming the metric, its threshold, its
values and the usual causes, before checkpointing that step. Each mismatch threshold, set below its healthy
value, stops a run of its own at step 1. The guard's rules, one by one on real rows, are
tests/trainer/test_fidelity_guard.py. Under torchrun (DP=2) every rank takes rank 0's verdict and stops
at the same step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rl.megatron_backend.distributed import free_port
from tests.faults.harness import Trainer, history, latest, stop_lines, train, train_command

STOP_ON = "trainer.stop_on={routing/agreement: 1.01, actor/grad_norm: {threshold: 1.0e-6, action: skip}}"
R3 = ("model.options.routing_replay=true", "algo.routing_replay=R3", "trainer.steps=3")


def test_thresholds_skip_updates_then_stop_the_run(fault_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, output = train(out, fault_model, *R3, STOP_ON)
    assert code == 3, output[-3000:]
    errors = stop_lines(output)
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert "routing/agreement=" in errors[0] and "at step 1 is below the trainer.stop_on threshold 1.01" in errors[0]
    assert "(last 1 steps: " in errors[0] and "R3" in errors[0], errors[0]
    # Both updates of step 1 were skipped (counted, with their norms), and the run stopped before saving step 1.
    assert output.count("above trainer.stop_on['actor/grad_norm'] threshold 1e-06; update skipped") == 2
    rows = history(out)
    assert [r["step"] for r in rows] == [1], rows
    assert rows[0]["actor/grad_norm_skipped"] == 2.0 and rows[0]["actor/grad_norm_max"] > 1e-6
    assert rows[0]["routing/agreement"] <= 1.0
    assert latest(out) is None


@pytest.mark.torchrun
def test_every_rank_stops_at_the_same_step_under_torchrun(fault_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # torchrun kills the other workers as soon as it sees one exit; polling every 5 s (not 0.1 s) leaves a rank
    # that stopped at the same step the time to print its line, while a rank left in a collective is still killed.
    torchrun = [shutil.which("torchrun") or "torchrun", "--nproc_per_node", "2", "--monitor-interval", "5"]
    torchrun.append(f"--master-port={free_port()}")
    overrides = ("trainer.steps=3", "trainer.stop_on={actor/grad_norm: 1.0e-6}")
    run = Trainer([*torchrun, "-m", *train_command(out, fault_model, *overrides)[2:]])
    code, output = run.wait(timeout=300), run.output()  # a rank left waiting in a collective would hang here
    assert code != 0, output[-3000:]
    errors = stop_lines(output)
    assert errors and all("actor/grad_norm=" in e and "at step 1 is above" in e for e in errors), output[-3000:]
    assert len(errors) == 2  # each worker ends with the one line (torchrun then reports its failed children)
    assert [r["step"] for r in history(out)] == [1] and latest(out) is None


@pytest.mark.parametrize(
    ("metric", "threshold"),
    [
        ("mismatch/logp_abs_diff_max", 1.0e-12),  # healthy: ~1e-5 (fp32 trainer and local engine)
        ("mismatch/k3_kl", -1.0),  # healthy: |k3| <= 3e-9, so every value is above -1
    ],
)
def test_a_mismatch_threshold_stops_the_run(fault_model: Path, tmp_path: Path, metric: str, threshold: float) -> None:
    out = tmp_path / "run"
    code, output = train(out, fault_model, "trainer.steps=2", f"trainer.stop_on={{{metric}: {threshold}}}")
    assert code == 3, output[-3000:]
    (line,) = stop_lines(output)
    assert f"{metric}=" in line and "at step 1 is above the trainer.stop_on threshold" in line, line
    assert "weight sync" in line  # the usual causes are named
    assert [r["step"] for r in history(out)] == [1] and latest(out) is None
