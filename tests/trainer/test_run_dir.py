"""Run lifecycle: one run per output folder, honest resume, clean Ctrl-C / SIGTERM.

End-to-end tests run `megatron-rl train` on the tiny MoE (a few steps of a tiny batch, no warm-up); the pure
parts (config identity, pruning, metrics cut-back, signal handlers) are tested on their own with real files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config, to_dict
from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoint
from megatron_rl.megatron_backend.distributed import free_port
from megatron_rl.tiny_model import make_tiny_qwen3_moe
from megatron_rl.trainer.guards.stop_signals import StopSignals, TrainingAborted
from megatron_rl.trainer.logs import run_dir
from megatron_rl.trainer.logs.run_log import RunLog, restore_history

CLI = [sys.executable, "-m", "megatron_rl.cli", "train"]
EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_moe_gspo.yaml"
TINY = [  # a step is a fraction of a second: 2 prompts x 2 samples, no warm-up, no evaluation, no plots
    "warmup.sft_steps=0",
    "data.eval=null",
    "data.eval_every=0",
    "rollout.prompts_per_step=2",
    "rollout.n_samples=2",
    "logging.wandb=false",
    "logging.plot=false",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("run_dir_model") / "model", seed=1234)


def _args(out: Path, model: Path, *overrides: str) -> list[str]:
    return [*CLI, str(EXAMPLE), f"trainer.output_dir={out}", f"model.hf_path={model}", *TINY, *overrides]


def _train(out: Path, model: Path, *overrides: str, code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(_args(out, model, *overrides), capture_output=True, text=True, timeout=600)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folder`: modification time and content hash."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megatron-rl train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with a checkpoint after each step."""
    out = tmp_path_factory.mktemp("finished") / "run"
    _train(out, model_dir, "trainer.steps=2", "trainer.save_every=1", "trainer.keep_last=0")
    assert _steps(out) == [1, 2] and (out / "run.json").is_file()
    return out


@pytest.fixture
def run_copy(finished: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


# ---------------------------------------------------------------------------------------------- end to end
def test_output_dir_that_is_a_file_fails_before_the_model_is_built(model_dir: Path, tmp_path: Path) -> None:
    file = tmp_path / "not_a_folder"
    file.write_text("x")
    proc = _train(file, model_dir, "trainer.steps=1", code=2)
    assert _error_line(proc) == (
        f"megatron-rl train: error: trainer.output_dir={file} is a file, not a folder: choose another "
        "trainer.output_dir"
    )
    assert "Loading weights" not in proc.stderr and "model:" not in proc.stdout  # nothing was built or printed


def test_a_finished_run_is_not_restarted_over_and_not_touched(model_dir: Path, run_copy: Path) -> None:
    before = _snapshot(run_copy)
    fresh = _error_line(_train(run_copy, model_dir, "trainer.steps=2", "trainer.resume=never", code=2))
    assert f"{run_copy} already holds another run's checkpoints or metrics" in fresh
    assert "trainer.resume=auto" in fresh and "another trainer.output_dir" in fresh
    assert "trainer.overwrite=true" in fresh and "nothing is deleted" in fresh
    other = _error_line(_train(run_copy, model_dir, "trainer.steps=2", "optimizer.lr=3e-4", code=2))
    assert "its run has another config: optimizer.lr" in other and "trainer.overwrite=true" in other
    done = _train(run_copy, model_dir, "trainer.steps=2")
    assert done.stdout.strip().splitlines()[-1] == (
        f"{run_copy}: the run is already complete (checkpoint step 2, trainer.steps=2); nothing to do. "
        "To train further, raise trainer.steps above 2"
    )
    assert "model:" not in done.stdout  # decided from trainer_state.json, before anything was built
    assert _snapshot(run_copy) == before


def test_overwrite_moves_the_old_run_aside(model_dir: Path, run_copy: Path) -> None:
    before, old_id = _snapshot(run_copy), json.loads((run_copy / "run.json").read_text())["run_id"]
    proc = _train(run_copy, model_dir, "trainer.steps=1", "trainer.resume=never", "trainer.overwrite=true")
    (aside,) = run_copy.parent.glob("run.old-*")
    assert f"moved the previous run in {run_copy} to {aside}" in proc.stdout
    assert _snapshot(aside) == before  # moved whole, not copied or changed
    assert _steps(run_copy) == [1]
    assert json.loads((run_copy / "run.json").read_text())["run_id"] != old_id


def test_incomplete_checkpoint_is_reported_and_metrics_are_cut_back(model_dir: Path, run_copy: Path) -> None:
    """A crash while step 2's checkpoint was damaged: metrics hold steps 1-2, only step 1's checkpoint is
    complete. The resume says so, continues from step 1 and logs every step exactly once, in order."""
    (run_copy / "checkpoints" / "step_000000002" / checkpoint.COMPLETE).unlink()
    proc = _train(run_copy, model_dir, "trainer.steps=3", "trainer.save_every=1", "trainer.keep_last=1")
    assert "step_000000002: incomplete (no COMPLETE marker), skipped" in proc.stdout
    assert f"resumed from {run_copy / 'checkpoints' / 'step_000000001'} at step 1" in proc.stdout
    assert _steps(run_copy) == [1, 2, 3]
    ckpts = run_copy / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000000003"]  # this run's: keep_last=1
    assert (ckpts / "latest").read_text().strip() == "step_000000003"


def test_only_incomplete_checkpoints_are_refused(model_dir: Path, run_copy: Path) -> None:
    for marker in (run_copy / "checkpoints").glob(f"step_*/{checkpoint.COMPLETE}"):
        marker.unlink()
    before = _snapshot(run_copy)
    line = _error_line(_train(run_copy, model_dir, "trainer.steps=3", code=2))
    assert "no complete checkpoint (step_000000001, step_000000002: incomplete" in line
    assert "refusing to start over from step 0" in line
    assert _snapshot(run_copy) == before


def test_pruning_keeps_another_runs_checkpoints(model_dir: Path, run_copy: Path) -> None:
    """A folder without run.json (an older version's run) is not resumed by `auto`; adopting it explicitly
    continues it, and keep_last=1 prunes only what this run writes."""
    (run_copy / "run.json").unlink()
    line = _error_line(_train(run_copy, model_dir, "trainer.steps=3", code=2))
    assert f"trainer.resume={run_copy / 'checkpoints'}" in line
    proc = _train(
        run_copy, model_dir, "trainer.steps=4", "trainer.save_every=1", "trainer.keep_last=1",
        f"trainer.resume={run_copy / 'checkpoints'}",
    )  # fmt: skip
    assert "adopting the run found there" in proc.stdout
    ckpts = run_copy / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000000001", "step_000000002", "step_000000004"]
    assert (ckpts / "latest").read_text().strip() == "step_000000004"
    assert _steps(run_copy) == [1, 2, 3, 4]


def _interrupt(args: list[str], signals: list[signal.Signals]) -> tuple[int, str]:
    """Start training in its own process group, send `signals` to the group (as a terminal's Ctrl-C does): the
    first once the first step is logged, each next one once the trainer said it got the previous one (its
    "SIGTERM: stopping at the end of this step ..." line); the exit code and the whole output."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, pending, cue = [], list(signals), re.compile(r"^step 1/")
    for line in proc.stdout:
        lines.append(line)
        if pending and cue.search(line):
            sig = pending.pop(0)
            os.killpg(proc.pid, sig)
            cue = re.compile(rf"{sig.name}: stopping at the end of this step")
    code, output = proc.wait(timeout=600), "".join(lines)
    assert not pending, f"{[s.name for s in pending]} not sent: no {cue.pattern!r} in the output\n{output[-3000:]}"
    return code, output


def test_ctrl_c_stops_at_a_step_boundary_and_resume_logs_every_step_once(model_dir: Path, tmp_path: Path) -> None:
    out, steps = tmp_path / "run", ("trainer.steps=12", "trainer.save_every=5")
    code, output = _interrupt(_args(out, model_dir, *steps), [signal.SIGINT])
    assert code == 130, output[-3000:]
    assert "Traceback" not in output
    (line,) = [line for line in output.splitlines() if line.startswith("interrupted at step")]
    stopped = int(line.split()[3].rstrip(";"))
    assert stopped < 12
    assert f"; last checkpoint step {stopped} (saved now: trainer.save_on_interrupt=true)" in line or (
        stopped % 5 == 0 and f"; last checkpoint step {stopped};" in line
    )
    resume = line.split("resume with: ", 1)[1]
    assert resume.startswith(f"megatron-rl train {EXAMPLE} ") and resume.endswith(" trainer.resume=auto")
    assert _steps(out) == list(range(1, stopped + 1))
    proc = _train(out, model_dir, *steps)
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped:09d}'} at step {stopped}" in proc.stdout
    assert _steps(out) == list(range(1, 13))


def test_second_signal_aborts_at_once(model_dir: Path, tmp_path: Path) -> None:
    """Two SIGTERMs: the second does not wait for the step boundary (it waits for a checkpoint write only).
    One line, no traceback, exit code 143; what is on disk still resumes."""
    out, steps = tmp_path / "run", ("trainer.steps=12", "trainer.save_every=0", "trainer.keep_last=0")
    code, output = _interrupt(_args(out, model_dir, *steps), [signal.SIGTERM, signal.SIGTERM])
    assert code == 143, output[-3000:]
    assert "Traceback" not in output
    assert output.strip().splitlines()[-1].startswith("interrupted ")
    assert "(SIGTERM" in output.strip().splitlines()[-1] and "resume with: megatron-rl train" in output


@pytest.mark.torchrun
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(model_dir: Path, tmp_path: Path) -> None:
    """Under torchrun (DP=2) only rank 1 gets SIGTERM: rank 0 learns it at the step boundary, both save the
    checkpoint of that step together (a collective: no rank waits forever) and stop."""
    import psutil

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
            str(Path(__file__).parents[2] / "megatron_rl" / "cli.py"), *_args(out, model_dir, "trainer.steps=30",
            "trainer.save_every=0")[3:]]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 1/"):
                for worker in psutil.Process(proc.pid).children(recursive=True):
                    if "RANK=1" in Path(f"/proc/{worker.pid}/environ").read_text().split("\0"):
                        os.kill(worker.pid, signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    output = "".join(lines)
    (line,) = [line for line in output.splitlines() if line.startswith("interrupted at step")]
    stopped = int(line.split()[3].rstrip(";"))
    assert stopped < 30 and "(saved now: trainer.save_on_interrupt=true)" in line, output[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:09d}"
    assert _steps(out) == list(range(1, stopped + 1))


# ---------------------------------------------------------------------------------------------- the parts
def test_run_identity_ignores_what_may_change_on_resume() -> None:
    base = load_config(EXAMPLE)
    same = load_config(EXAMPLE, ["trainer.steps=7", "trainer.resume=never", "logging.wandb=false",
                                 "trainer.save_every=3", "trainer.output_dir=/elsewhere", "trainer.async_save=true",
                                 "algo.replay_check=first_step", "algo.replay_agreement_every=10"])  # fmt: skip
    assert run_dir.config_hash(same) == run_dir.config_hash(base)
    other = load_config(EXAMPLE, ["algo.preset=grpo"])
    assert run_dir.config_hash(other) != run_dir.config_hash(base)
    assert "algo.loss" in run_dir.changed_keys(to_dict(base), to_dict(other))
    # A run started before model.options.expert_bias_update_rate existed resumes; a non-default value is another run.
    before_the_key = to_dict(base)
    del before_the_key["model"]["options"]["expert_bias_update_rate"]
    assert run_dir.config_hash(before_the_key) == run_dir.config_hash(base)
    moving = load_config(EXAMPLE, ["model.options.expert_bias_update_rate=0.001"])
    assert run_dir.changed_keys(to_dict(base), to_dict(moving)) == ["model.options.expert_bias_update_rate"]


def _fake_checkpoint(root: Path, step: int, run_id: str | None, *, complete: bool = True) -> Path:
    """A checkpoint folder as far as the run-directory logic reads it: COMPLETE and trainer_state.json."""
    path = root / checkpoint.step_dir_name(step)
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "run_id": run_id, "trainer": {}}))
    if complete:
        (path / checkpoint.COMPLETE).write_text("ok\n")
    return path


def test_prune_keeps_latest_and_other_runs(tmp_path: Path) -> None:
    for step, run in ((1, "theirs"), (2, "ours"), (3, "ours"), (4, "theirs"), (5, "ours")):
        _fake_checkpoint(tmp_path, step, run)
    _fake_checkpoint(tmp_path, 6, "ours", complete=False)
    (tmp_path / "latest").write_text("step_000000003\n")  # names an older one of ours
    checkpoint.prune_checkpoints(tmp_path, keep_last=1, run_id="ours")
    left = sorted(p.name[-1] for p in tmp_path.glob("step_*"))
    assert left == ["1", "3", "4", "5", "6"]  # 2 pruned; 3 is latest; theirs and the incomplete one untouched


def test_plan_refuses_to_start_over_when_only_incomplete_checkpoints_exist(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = load_config(EXAMPLE, [f"trainer.output_dir={out}"])
    plan = run_dir.plan_run(cfg)
    run_dir.start_run(plan)
    _fake_checkpoint(out / "checkpoints", 2, plan.identity.run_id, complete=False)
    with pytest.raises(checkpoint.CheckpointError, match="refusing to start over from step 0"):
        run_dir.plan_run(cfg)
    _fake_checkpoint(out / "checkpoints", 1, plan.identity.run_id)
    again = run_dir.plan_run(cfg)
    assert again.identity == plan.identity and again.start_step == 1 and again.first_logged_step == 2
    assert again.notes == ("step_000000002: incomplete (no COMPLETE marker), skipped",)


def test_restore_history_keeps_each_step_once_in_order(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": float(i)} for i, s in enumerate([0, 1, 2, 3, 2, 3, 4])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "x"')  # the last line cut off
    kept = restore_history(path, first_step=4)
    assert [r["step"] for r in kept] == [0, 1, 2, 3] and kept[2]["x"] == 4.0  # the later row of a repeated step
    assert [json.loads(line) for line in path.read_text().splitlines()] == kept


def test_run_log_resumes_history_and_tensorboard(tmp_path: Path) -> None:
    """A resumed RunLog holds the earlier steps (plots and the summary cover the whole run) and TensorBoard
    forgets the events of the steps that are redone."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rl.config.schema import LoggingConfig

    cfg = LoggingConfig(wandb=False, tensorboard=True, plot=False)
    first = RunLog(cfg, tmp_path, 4, {})
    for step in (1, 2, 3):
        first.log(step, {"actor/pg_loss": float(step)})
    first.close()  # a crash after step 3; the checkpoint is at step 2
    second = RunLog(cfg, tmp_path, 4, {}, first_step=3)
    assert [r["step"] for r in second.history] == [1, 2]
    for step in (3, 4):
        second.log(step, {"actor/pg_loss": 10.0 * step})
    second.close()
    assert [r["actor/pg_loss"] for r in second.history] == [1.0, 2.0, 30.0, 40.0]
    assert _steps(tmp_path) == [1, 2, 3, 4]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_stop_signals_restore_the_previous_handlers() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with StopSignals("megatron-rl train x.yaml trainer.resume=auto", announce=False) as stop:
        assert signal.getsignal(signal.SIGINT) != before[signal.SIGINT]
        with pytest.raises(TrainingAborted, match="before training started") as aborted:
            os.kill(os.getpid(), signal.SIGTERM)  # not armed yet: aborts at once
        assert aborted.value.exit_code == 143
        stop.armed, stop.step = True, 3
        os.kill(os.getpid(), signal.SIGINT)  # armed: only asks
        assert stop.agreed() == signal.SIGINT
        with pytest.raises(TrainingAborted, match="interrupted during step 3"):
            os.kill(os.getpid(), signal.SIGINT)
    assert {sig: signal.getsignal(sig) for sig in before} == before
