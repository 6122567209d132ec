"""`trainer.mode: async` in the real loop (P15): k = 0 is the sync loop exactly; k = 1 trains every sample exactly
one version behind with the first update on-policy against θ_old; a run killed with SIGKILL resumes to the same
rows as an uninterrupted one; a dead engine process is restarted; partial rollouts stay within the bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests.shared_runs import TRAIN, WarmedModel
from tests.waiting import wait_until

COMMON = (
    "warmup.sft_steps=0", "data.eval=synthetic", "data.eval_every=2", "data.eval_prompts=32", "trainer.save_every=0",
    "logging.wandb=false", "logging.plot=false", "optimizer.lr=1e-4",
)  # fmt: skip
TIMING = ("time/", "perf/", "async/trainer_wait_s", "async/engine_wait_s", "async/generate_s", "async/batches_ready",
          "actor/ppo_kl_first_checked")  # a resumed run checks its first update against a scoring pass


def _command(out: Path, model: Path, *overrides: str) -> list[str]:
    return [*TRAIN, f"trainer.output_dir={out}", f"model.hf_path={model}", *COMMON, *overrides]


def _train(out: Path, model: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run(_command(out, model, *overrides), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return _rows(out)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _comparable(rows: list[dict]) -> dict[int, dict]:
    # sync/: a resumed start verifies its first sync (rollout.verify_sync); the uninterrupted run did not there
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith((*TIMING, "sync/"))} for r in rows}


def test_async_with_staleness_0_is_the_sync_loop(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    steps = ("trainer.steps=3", "algo.rollout_correction=none", "rollout.engine_process=trainer")
    sync = _train(tmp_path / "sync", warmed_demo.warmed, *steps)
    async0 = _train(tmp_path / "async0", warmed_demo.warmed, *steps, "trainer.mode=async", "trainer.max_staleness=0")
    assert [r["step"] for r in sync] == [0, 1, 2, 3]
    a, b = _comparable(sync), _comparable(async0)
    for step in a:
        extra = {k for k in b[step] if k.startswith("async/")}
        assert {k: v for k, v in b[step].items() if k not in extra} == a[step], step
        if step:
            assert b[step]["async/staleness_max"] == 0.0


def test_one_step_off_policy_trains_every_sample_one_version_behind(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    """The default async run: the engine in its own process, k = 1, TIS correction on by default."""
    rows = _train(tmp_path / "run", warmed_demo.warmed, "trainer.steps=4", "trainer.mode=async")
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "rollout_correction: tis" in config
    steps = [r for r in rows if r["step"] > 0]
    for r in steps:
        assert r["actor/ppo_kl_first"] == 0.0  # on-policy against θ_old, the trainer's own scoring
        expected = 0.0 if r["step"] == 1 else 1.0  # step 1 trains on version 0, the start: nothing older exists
        assert r["async/staleness_max"] == r["async/staleness_mean"] == expected
        assert 0.5 < r["actor/rollout_is_weight_mean"] < 2.0
        if r["step"] > 1:  # behaviour (one version old) vs θ_old: a real, small gap the correction weighs
            assert 0.0 < r["mismatch/k3_kl"] < 0.1
    # The evaluations (steps 0, 2, 4) ran on the weights of their step, between the producer's requests.
    evaluated = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 4]
    for r in evaluated:
        assert r["eval/weight_version"] == r["step"] and r["time/eval/synthetic"] > 0


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _wait_for_step(out: Path, proc: subprocess.Popen, step: int) -> None:
    def reached() -> bool:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        return (out / "metrics.jsonl").is_file() and any(r["step"] >= step for r in _rows(out))

    wait_until(reached, 600, f"step {step}", interval_s=0.05)


def test_sigkill_and_resume_continue_exactly(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    """Checkpoints keep the generated, untrained batch; resumed runs train no sample twice and lose none: the rows
    equal an uninterrupted run's (the async schedule is a function of the step)."""
    run = ("trainer.steps=6", "trainer.mode=async", "trainer.save_every=1", "trainer.keep_last=0")
    whole = _train(tmp_path / "whole", warmed_demo.warmed, *run)
    split = tmp_path / "split"
    proc = subprocess.Popen(_command(split, warmed_demo.warmed, *run), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        _wait_for_step(split, proc, 3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed = _train(split, warmed_demo.warmed, *run)
    assert [r["step"] for r in resumed] == list(range(7))
    assert _comparable(resumed) == _comparable(whole)


def test_a_dead_engine_process_is_restarted(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(_command(out, warmed_demo.warmed, "trainer.steps=8", "trainer.mode=async"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for_step(out, proc, 2)
        # Spawned children: the checkpoint writer's helper (started first) and the engine process (started after).
        child = max(c for c in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())
        os.kill(child, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    rows = [r for r in _rows(out) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert sum(r["rollout/restarts"] for r in rows) >= 1, "the engine process was not restarted"
    assert "restarted ['local engine process']" in stdout + stderr


def test_partial_rollouts_stay_within_the_staleness_bound(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    rows = _train(tmp_path / "run", warmed_demo.warmed, "trainer.steps=4", "trainer.mode=async", "rollout.partial=true",
                  "rollout.sampling.max_new_tokens=32")  # fmt: skip
    for r in (r for r in rows if r["step"] > 0):
        assert r["async/staleness_max"] <= 1.0 and r["actor/ppo_kl_first"] == 0.0
        assert 0.0 <= r["async/partial_share"] <= 1.0
