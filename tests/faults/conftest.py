"""Shared by the fault tests: one tiny model and one uninterrupted reference run of the shared configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.faults.harness import STEPS, Trainer, history, latest, train_command


@dataclass(frozen=True)
class Reference:
    out: Path
    rows: list[dict]  # metrics.jsonl: steps 1..STEPS
    startup_s: float  # launch -> the first step starts (imports, model build, first weight sync)
    final: Path  # the last checkpoint


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("fault_model") / "model", seed=1234)


@pytest.fixture(scope="session")
def reference(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    out = tmp_path_factory.mktemp("fault_reference") / "run"
    run = Trainer(train_command(out, fault_model))
    run.wait_for(rf"^step 1/{STEPS}\b")
    first_line = run.lines[-1][0] if run.lines else run.started
    assert run.wait() == 0, run.output()[-3000:]
    rows = history(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    step1 = rows[0]
    startup = max(first_line - run.started - step1["time/step"] - step1.get("time/checkpoint", 0.0), 0.5)
    return Reference(out, rows, startup, latest(out))
