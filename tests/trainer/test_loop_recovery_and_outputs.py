"""What a run leaves behind and how it survives a rollout failure, on the tiny demo (3 steps):
wandb's offline run and TensorBoard's event files hold the logged metrics, `trainer.keep_last` rotates the
checkpoints, and a local engine that fails once is restarted, re-synced and retried to the same result."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_train_loop import EXAMPLE, FAST, _history, _train, model_dir  # noqa: F401 - a fixture

FAILING = Path(__file__).parent / "scripts" / "train_with_failing_engine.py"
STEPS = 3
# FAST's warm-up (150 steps): the model answers some prompts, so rewards, losses and gradients are not all 0.
COMMON = (f"trainer.steps={STEPS}", "data.eval=null", "data.eval_every=0", "trainer.save_every=1",
          "trainer.keep_last=2", "logging.plot=false")  # fmt: skip


def _outcome(row: dict) -> dict:
    """A metrics row without what depends on the clock or on the number of restarts (a restart re-sends the
    weights: the step's sync counts and bytes grow)."""
    restarts = ("rollout/restarts", "sync/bytes", "sync/tensors", "sync/full_syncs")
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and k not in restarts}


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The un-failed run, with wandb in its default mode (`auto`: offline without an API key) and TensorBoard on."""
    out = tmp_path_factory.mktemp("reference") / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR")}
    _train(out, model_dir, *COMMON, "logging.wandb=true", "logging.tensorboard=true", env=env)
    return out


def test_tensorboard_events_hold_the_logged_metrics(reference: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = _history(reference)
    events = EventAccumulator(str(reference / "tensorboard"))
    events.Reload()
    for key in ("rollout/reward_mean", "actor/pg_loss", "actor/grad_norm"):
        logged = [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in history if key in r]
        assert len(logged) == STEPS and [(e.step, e.value) for e in events.Scalars(key)] == logged, key


def _wandb_history(path: Path) -> dict[int, dict[str, float]]:
    """The rows `wandb.log` wrote into an offline run's transaction log, by step.

    The file is a 7-byte header (`:W&B`, magic, version) and then LevelDB's log format: 32 KiB blocks of chunks
    `crc32c (4) | length (2, little-endian) | type (1: full, 2: first, 3: middle, 4: last) | data`, each record a
    serialised `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    rows, pos, record = {}, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        record += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            record = b""
            if parsed.WhichOneof("record_type") == "history":
                items = parsed.history.item  # a key is in `key`, or split into `nested_key`
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
                rows[row["_step"]] = row
    return rows


def test_wandb_writes_an_offline_run_without_an_api_key(reference: Path) -> None:
    run_id = json.loads((reference / "run.json").read_text())["wandb_id"]
    (run_dir,) = (reference / "wandb").glob(f"offline-run-*-{run_id}")
    logged = _wandb_history(run_dir / f"run-{run_id}.wandb")
    history = _history(reference)
    assert sorted(logged) == [r["step"] for r in history] == list(range(1, STEPS + 1))
    for row in history:
        for key in ("rollout/reward_mean", "actor/pg_loss", "actor/grad_norm", "mismatch/logp_abs_diff"):
            assert logged[row["step"]][key] == pytest.approx(row[key], rel=1e-12), (row["step"], key)


def test_keep_last_rotates_checkpoints(reference: Path) -> None:
    """save_every=1, keep_last=2 over 3 steps: step 1's checkpoint went when step 3's was published."""
    checkpoints = reference / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000000002", "step_000000003"]
    assert all((checkpoints / name / "COMPLETE").is_file() for name in ("step_000000002", "step_000000003"))
    assert (checkpoints / "latest").read_text().strip() == "step_000000003"


def test_rollout_failure_restarts_resyncs_and_retries_to_the_same_step(
    reference: Path,
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The first rollout raises RolloutEngineError (its engine holding its launch weights again, as a restarted
    server would): the loop recovers the engine, re-sends the current weights, retries from the same prompt
    position, and every step's outcome equals the un-failed run's."""
    out, calls = tmp_path / "run", tmp_path / "engine_calls.jsonl"
    proc = subprocess.run(
        [sys.executable, str(FAILING), "train", str(EXAMPLE), f"trainer.output_dir={out}",
         f"model.hf_path={model_dir}", *FAST, *COMMON],
        capture_output=True, text=True, timeout=900, env={**os.environ, "ENGINE_CALLS": str(calls)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "step 1: rollout failed (injected: the rollout server died); restarted nothing, retrying" in proc.stdout
    log = [json.loads(line) for line in calls.read_text().splitlines()]
    failed, recover, resync, retried = log[1:5]  # log[0]: the first sync, after the warm-up
    assert log[0] == {"call": "update_weights", "version": "step-0"}
    assert failed["call"] == "generate" and failed["version"] == "step-0"
    assert recover == {"call": "recover"}
    assert resync == {"call": "update_weights", "version": "step-0"}  # not the launch weights it held
    assert retried == failed  # the same prompts at the same weights: the position was restored
    failing, unfailed = _history(out), _history(reference)
    assert [r["rollout/restarts"] for r in failing] == [1.0, 0.0, 0.0]
    assert [_outcome(r) for r in failing] == [_outcome(r) for r in unfailed]
    # The comparison can tell runs apart: every step has rewards, and the policy moves.
    assert all(r["rollout/reward_mean"] > 0 for r in unfailed) and any(r["actor/grad_norm"] > 0 for r in unfailed)
