"""A NaN/inf loss (here: a reward function whose values overflow float32 at step 2, so the advantages and the
loss are not finite) stops the run with one line naming the step and micro-batch, or, with
trainer.on_nonfinite=skip, drops those updates, counts them, and trains on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.harness import Trainer, all_finite, error_lines, history, latest, train_command

OVERFLOW = ("data.reward=tests.faults.fault_rewards:overflow_at_step_2", "trainer.steps=3")


@pytest.fixture(scope="module")
def runs(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """Both policies, run side by side (start-up is single-threaded: two cores start two runs at once)."""
    root = tmp_path_factory.mktemp("nonfinite")
    started = {
        mode: (root / mode, Trainer(train_command(root / mode, fault_model, *OVERFLOW, f"trainer.on_nonfinite={mode}")))
        for mode in ("stop", "skip")
    }
    return {mode: (out, run.wait(), run.output()) for mode, (out, run) in started.items()}


def test_nonfinite_loss_stops_with_step_and_micro_batch(runs: dict) -> None:
    out, code, output = runs["stop"]
    assert code == 2, output[-3000:]
    errors = error_lines(output)
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert "non-finite loss at step 2, update 1 of 2, micro-batch 1 of" in errors[0], errors[0]
    assert "pg_loss=" in errors[0] and "trainer.on_nonfinite=skip" in errors[0]
    # Nothing non-finite reached the weights: the checkpoint of step 1 is the latest and is finite.
    assert latest(out).name == "step_000000001" and all_finite(latest(out))
    assert [r["step"] for r in history(out)] == [1]


def test_nonfinite_loss_skipped_and_counted(runs: dict) -> None:
    out, code, output = runs["skip"]
    assert code == 0, output[-3000:]
    assert output.count("update skipped (trainer.on_nonfinite=skip)") == 2
    rows = history(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["actor/nonfinite_skipped"] for r in rows] == [0.0, 2.0, 0.0]
    assert rows[2]["actor/grad_norm"] > 0  # step 3 trains again
    final = latest(out)
    assert final.name == "step_000000003" and all_finite(final)
    saved = json.loads((final / "trainer_state.json").read_text())
    assert saved["actor_step"] == 4  # 3 steps x 2 updates, the 2 of step 2 skipped
