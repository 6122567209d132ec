"""A run killed (SIGKILL) at random moments, or stopped (SIGTERM, Ctrl-C), and resumed ends exactly where an
uninterrupted run ends: the same weights, optimizer state and RNG bit for bit, every step logged once."""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.megatron_backend.distributed import free_port
from tests.faults.conftest import Reference
from tests.faults.harness import (
    REPO,
    STEPS,
    Trainer,
    comparable,
    compare_checkpoints,
    error_lines,
    history,
    latest,
    train_command,
)
from tests.waiting import wait_until

# Ten kills: where each lands is drawn at random (seeded) within its phase; the phases are shuffled.
PHASES = ("startup",) * 2 + ("rollout", "training", "checkpoint write") * 2 + ("weight sync", "checkpoint published")
KILLS = len(PHASES)


def _step_of(checkpoint: Path | None) -> int:
    return int(checkpoint.name.split("_")[1]) if checkpoint is not None else 0


def _kill_at_random_moment(out: Path, model: Path, ref: Reference, phase: str, rng: random.Random) -> dict:
    """Start (or resume) the run and SIGKILL it, with its checkpoint writers, in `phase`:

    - startup: a uniform random moment of the reference run's start-up (imports, model build, first sync);
    - rollout / training / weight sync of the step after the next one: a uniform random moment within that
      phase's duration in the reference run, counted from the previous step's line;
    - checkpoint write: a random moment within the reference's save time after its `.tmp_step_*` appears;
    - checkpoint published: the moment `latest` names the new checkpoint, before the step's metrics row.

    A kill happens at the latest when the step's line appears, so every kill lands in an unfinished run."""
    start = _step_of(latest(out))
    target = start + 2
    if target > STEPS:
        phase = "startup"  # one step left: only the start-up can still be hit
    run = Trainer(train_command(out, model))
    ckpts = out / "checkpoints"
    done = re.compile(rf"^step {target if phase != 'startup' else start + 1}/{STEPS}\b")
    if phase == "startup":
        delay = rng.uniform(0.0, ref.startup_s)
    else:
        assert run.wait_for(rf"^step {target - 1}/{STEPS}\b") is not None, run.output()[-3000:]
        row = ref.rows[target - 1]
        rollout, train = row["time/rollout"], row["time/old_logp"] + row["time/train"]
        delay = {
            "rollout": lambda: rng.uniform(0.0, rollout),
            "training": lambda: rng.uniform(rollout, rollout + train),
            "weight sync": lambda: rng.uniform(rollout + train, rollout + train + row["time/weight_sync"]),
            "checkpoint write": lambda: rng.uniform(0.0, row.get("time/checkpoint", 0.0)),
            "checkpoint published": lambda: 0.0,
        }[phase]()

        def over() -> bool:  # the step ended or the run exited: the kill comes now, too late for the phase
            return run.seen(done) or run.proc.poll() is not None

        if phase == "checkpoint write":
            tmp = ckpts / f".tmp_step_{target:09d}"
            wait_until(lambda: tmp.exists() or over(), 600, f"{tmp.name} to appear", interval_s=0.001)
        if phase == "checkpoint published":
            wait_until(lambda: _step_of(latest(out)) >= target or over(), 600, f"latest to name step {target}",
                       interval_s=0.0005)  # fmt: skip
    # The random delay is the fault's timing (where in the phase the kill lands), not a wait for anything; it is
    # cut short when the step ends first.
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and not run.seen(done) and run.proc.poll() is None:
        time.sleep(0.001)  # simulated work: the run goes on until the kill's moment
    writing = sorted(p.name for p in ckpts.glob(".tmp_step_*"))  # evidence of a checkpoint write in progress
    run.signal(signal.SIGKILL)
    code = run.wait()
    after = latest(out)
    if after is not None:  # whatever the moment, `latest` names a complete checkpoint
        assert (after / "COMPLETE").is_file(), f"latest names {after}, which is incomplete"
    return {"phase": phase, "step": target, "delay_s": round(delay, 3), "killed": code == -signal.SIGKILL,
            "writing": writing, "latest_before": start, "latest_after": _step_of(after)}  # fmt: skip


def test_sigkill_at_random_moments_then_resume_is_exact(fault_model: Path, reference: Reference, tmp_path: Path):
    seed = int(os.environ.get("FAULTS_SEED", "20261130"))
    rng = random.Random(seed)
    out = tmp_path / "run"
    phases = list(PHASES)
    rng.shuffle(phases)
    t0 = time.monotonic()
    kills = []
    for phase in phases:
        kills.append(record := _kill_at_random_moment(out, fault_model, reference, phase, rng))
        print(f"kill {len(kills)}: {record}")
    last = Trainer(train_command(out, fault_model))
    assert last.wait() == 0, last.output()[-3000:]
    killed = sum(k["killed"] for k in kills)
    assert killed == KILLS, kills

    final = latest(out)
    assert final is not None and final.name == reference.final.name
    cmp = compare_checkpoints(final, reference.final)
    steps = [r["step"] for r in history(out)]
    missing, repeated = sorted(set(range(1, STEPS + 1)) - set(steps)), len(steps) - len(set(steps))
    print(
        f"fault suite (seed {seed}): faults injected: {killed} SIGKILL ({', '.join(sorted(set(phases)))}); "
        f"runs resumed: {len(kills)}; bytes lost: {cmp.bytes_lost} of {cmp.bytes_compared} checkpoint tensor bytes "
        f"({cmp.tensors} tensors; {cmp.padding} padding elements not compared); metrics rows: {len(steps)} of "
        f"{STEPS}, missing {missing}, repeated {repeated}; {time.monotonic() - t0:.0f} s"
    )
    assert cmp.different == [], f"differs from the uninterrupted run: {cmp.different[:10]}"
    assert cmp.bytes_lost == 0
    assert steps == list(range(1, STEPS + 1)), "every step logged exactly once, in order"
    assert comparable(history(out)) == comparable(reference.rows)


def _stop(run: Trainer, signum: int, after_step: int, ref: Reference) -> re.Match:
    """Signal the run in the middle of the rollout of step `after_step + 1`; it stops at the end of that step."""
    assert run.wait_for(rf"^step {after_step}/{STEPS}\b") is not None, run.output()[-3000:]
    time.sleep(ref.rows[after_step]["time/rollout"] / 2)  # simulated work: the signal's timing, mid-rollout
    run.signal(signum)
    code = run.wait()
    assert code == 128 + signum, (code, run.output()[-3000:])
    line = re.compile(r"^interrupted at step (\d+); last checkpoint step (\d+)\b.*; resume with: (.+)$", re.M)
    match = line.search(run.output())
    assert match is not None, run.output()[-3000:]
    assert "Traceback" not in run.output() and "KeyboardInterrupt" not in run.output()
    return match


def test_sigterm_and_ctrl_c_stop_cleanly_and_resume_exactly(fault_model: Path, reference: Reference, tmp_path: Path):
    """Both signals go to the whole process group, as a terminal's Ctrl-C and SLURM's scancel send them (the
    trainer's helper processes get them too)."""
    out = tmp_path / "run"
    ctrl_c = _stop(Trainer(train_command(out, fault_model)), signal.SIGINT, 2, reference)
    stopped, saved = int(ctrl_c[1]), int(ctrl_c[2])
    assert saved == stopped == _step_of(latest(out))  # stops at a step boundary and saves there
    term = _stop(Trainer(train_command(out, fault_model)), signal.SIGTERM, stopped + 2, reference)
    assert int(term[2]) == int(term[1]) == _step_of(latest(out))
    # The printed command resumes the run.
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the console script does not put the cwd on sys.path
    done = subprocess.run(shlex.split(term[3]), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = history(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert comparable(rows) == comparable(reference.rows)
    cmp = compare_checkpoints(latest(out), reference.final)
    assert cmp.different == [] and cmp.bytes_lost == 0


def test_sigkill_during_background_save_then_resume_is_exact(fault_model: Path, reference: Reference, tmp_path: Path):
    """trainer.async_save=true: a checkpoint is written by a writer thread while the next step runs and published by
    it once written; the next save (or the end of the run) waits for it. A SIGKILL right after a save started (its
    step logged) or at a random moment of its write leaves `latest` complete: the previous checkpoint while the
    save's staging folder is unpublished, this one once it is published, never a half-written one; resuming in the
    same mode ends bit for bit where the uninterrupted synchronous run ends."""
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    rng = random.Random(int(os.environ.get("FAULTS_SEED", "20261130")))
    kills = []
    for moment in ("save just started", "random moment of the write", "save just started"):
        start = _step_of(latest(out))
        target = start + 2
        run = Trainer(train_command(out, fault_model, "trainer.async_save=true"))
        staging = ckpts / f".tmp_step_{target:09d}"
        if moment == "save just started":
            assert run.wait_for(rf"^step {target}/{STEPS}\b") is not None, run.output()[-3000:]
        else:
            assert run.wait_for(rf"^step {target - 1}/{STEPS}\b") is not None, run.output()[-3000:]
            written = lambda: staging.exists() or run.proc.poll() is not None  # noqa: B023, E731 (called here)
            wait_until(written, 600, f"{staging.name} to appear", interval_s=0.001)
            # The kill's random moment within the write: the fault's timing, not a wait for anything.
            pause = rng.uniform(0.0, reference.rows[target - 1].get("time/checkpoint", 0.0) + 0.5)
            time.sleep(pause)  # simulated work: the write goes on until the kill's moment
        run.signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL, run.output()[-3000:]
        unpublished = staging.is_dir()  # the write of step `target` was under way: its staging folder not renamed
        after = latest(out)
        assert after is not None and (after / "COMPLETE").is_file(), f"latest names {after}, which is incomplete"
        if moment == "save just started":  # the step's save was started: published whole, or not at all
            assert _step_of(after) == (target - 1 if unpublished else target), (staging, after)
        kills.append(
            {"moment": moment, "step": target, "write_under_way": unpublished, "latest_after": _step_of(after)}
        )
        print(f"kill {len(kills)}: {kills[-1]}")
    assert any(k["write_under_way"] for k in kills), f"no kill landed while a background save was written: {kills}"
    last = Trainer(train_command(out, fault_model, "trainer.async_save=true"))
    assert last.wait() == 0, last.output()[-3000:]
    final = latest(out)
    assert final is not None and final.name == reference.final.name
    assert not list(ckpts.glob(".tmp_step_*")), "the last background save was published before the run returned"
    cmp = compare_checkpoints(final, reference.final)
    assert cmp.different == [], f"differs from the uninterrupted run: {cmp.different[:10]}"
    assert cmp.bytes_lost == 0 and cmp.bytes_compared > 0
    rows = history(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "every step logged exactly once, in order"
    assert comparable(rows) == comparable(reference.rows)


@pytest.mark.torchrun
def test_ctrl_c_under_torchrun_stops_cleanly_and_its_command_resumes(
    fault_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torchrun --nproc_per_node 2 -m megatron_rl.cli train ...` (DP=2) and a Ctrl-C to its process group (the
    terminal's): every rank stops at the step boundary and saves; no worker prints a traceback (the only one is
    torchrun's own SignalException, exit code 1, as docs/reliability.md says); the printed resume command is the
    torchrun command line, and running it as printed ends with the rows of an uninterrupted torchrun run."""
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")  # a loaded CI machine may need more than 30 s
    steps = "trainer.steps=8"
    torchrun = [shutil.which("torchrun") or "torchrun", "--nproc_per_node", "2"]

    def command(out: Path) -> list[str]:
        return [*torchrun, f"--master-port={free_port()}", "-m", *train_command(out, fault_model, steps)[2:]]

    ref = Trainer(command(tmp_path / "reference"))
    assert ref.wait() == 0, "\n".join(error_lines(ref.output())) or ref.output()[-3000:]
    out = tmp_path / "run"
    run = Trainer(command(out))
    assert run.wait_for(r"^step 1/8\b") is not None, run.output()[-3000:]
    run.signal(signal.SIGINT)
    code, output = run.wait(), run.output()
    assert code == 1, output[-3000:]  # torchrun's agent: SignalException, whatever the workers do
    tracebacks = output.count("Traceback (most recent call last)")
    assert tracebacks == len(re.findall(rf"SignalException: Process {run.proc.pid} got signal: 2$", output, re.M))
    assert "KeyboardInterrupt" not in output and "ChildFailedError" not in output, output[-3000:]
    (line,) = [line for line in output.splitlines() if line.startswith("interrupted at step")]
    match = re.match(r"interrupted at step (\d+); last checkpoint step (\d+)\b.*; resume with: (.+)$", line)
    assert match is not None and match[1] == match[2] and int(match[1]) < 8, line
    assert int(match[1]) == _step_of(latest(out))
    resume = shlex.split(match[3])
    launcher = resume[: resume.index("-m")]
    assert Path(launcher[-4]).name == "torchrun" and launcher[-3:-1] == ["--nproc_per_node", "2"], resume
    assert resume[resume.index("-m") : resume.index("-m") + 3] == ["-m", "megatron_rl.cli", "train"]
    assert resume[-1] == "trainer.resume=auto" and "trainer.steps=8" in resume
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(resume, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows, expected = comparable(history(out)), comparable(history(tmp_path / "reference"))
    assert [r["step"] for r in rows] == list(range(1, 9))
    for got, want in zip(rows, expected, strict=True):
        assert got.keys() == want.keys()
        assert got == {k: pytest.approx(v, rel=1e-6, abs=1e-9) for k, v in want.items()}, got["step"]


@pytest.mark.slow  # the default tier's torchrun Ctrl-C test covers the stop; this adds only the wrapper's line
@pytest.mark.torchrun
def test_the_slurm_templates_torchrun_stops_without_a_traceback(
    fault_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/slurm runs torchrun as `python -m megatron_rl.launch.torchrun`: a SIGTERM to the job (scancel) ends
    it with the workers' stop line and one line of torchrun's, exit code 143, no traceback."""
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")  # the step and its save, on a loaded machine
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "megatron_rl.launch.torchrun", "--nproc_per_node", "2",
              f"--master-port={free_port()}"]  # fmt: skip
    run = Trainer([*launch, "-m", *train_command(out, fault_model, "trainer.steps=8")[2:]])
    assert run.wait_for(r"^step 1/8\b") is not None, run.output()[-3000:]
    run.signal(signal.SIGTERM)
    code, output = run.wait(), run.output()
    assert code == 143, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert output.splitlines()[-1].startswith("torchrun: stopped by SIGTERM; the workers stopped at a step boundary")
    (line,) = [line for line in output.splitlines() if line.startswith("interrupted at step")]
    assert int(line.split()[3].rstrip(";")) == _step_of(latest(out))


def test_resume_command_outside_torchrun_and_under_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain command drops trainer.resume/overwrite overrides and adds trainer.resume=auto; under SLURM the line
    says to resubmit the job first; a torchrun worker whose agent cannot be read says to keep torchrun's options."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.logs.run_dir import resume_command

    monkeypatch.chdir(REPO)
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    overrides = ["model.hf_path=/m", "trainer.resume=never", "trainer.overwrite=true", "rollout.n_samples=4"]
    cfg = load_config("examples/tiny_moe_gspo.yaml", overrides)
    plain = ("megatron-rl train examples/tiny_moe_gspo.yaml model.hf_path=/m rollout.n_samples=4 trainer.resume=auto "
             "trainer.overwrite=false")  # fmt: skip
    assert resume_command(cfg, "examples/tiny_moe_gspo.yaml", overrides) == plain
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert resume_command(cfg, "examples/tiny_moe_gspo.yaml", overrides) == (
        f"sbatch the same job script again (SLURM job 4242; trainer.resume=auto continues the run) or {plain}"
    )
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(sys, "argv", ["cli.py", "not", "the", "parent's", "arguments"])
    assert resume_command(cfg, None) == (
        "torchrun (with this run's options) -m megatron_rl.cli train runs/tiny_moe_gspo/config.yaml "
        "trainer.resume=auto trainer.overwrite=false"
    )
