"""`ProcessEngine` (the local engine in a child process) against the in-process `LocalEngine`: the same samples,
weight updates (also while a generate is in flight), abort, a killed or hung child and its recovery, shutdown,
a child outliving no parent, and the factory's choice."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import load_config
from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engine import RolloutEngineError
from megatron_rl.rollout.engines.engine_factory import build_engine, local_engine_process
from megatron_rl.rollout.engines.engine_process import ProcessEngine
from megatron_rl.rollout.engines.hf_weight_loading import WeightUpdateError
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.tiny_model import make_tiny_qwen3_moe
from megatron_rl.trainer.rollout_phase import engine_run
from tests.waiting import wait_until

PROMPTS = [[10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33]]
SEEDED = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    return _shm_entries()


@pytest.fixture(scope="module")
def process_engine(tiny_dir: Path, shm_before: set[str]):
    """Built by the factory from an async config (engine_process=auto: a child process)."""
    cfg = load_config(None, [f"model.hf_path={tiny_dir}", "trainer.mode=async"])
    engine = build_engine(cfg.rollout, engine_run(cfg), tiny_dir, torch.device("cpu"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def weights(tiny_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(tiny_dir / "model.safetensors").items())


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, torch.Tensor]]:
    """Another random model of the same shape."""
    other = make_tiny_qwen3_moe(tmp_path_factory.mktemp("other"), seed=1)
    return sorted(load_file(other / "model.safetensors").items())


def assert_same_samples(got, expected, atol: float = 1e-6) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert a.group_index == b.group_index and a.prompt_ids == b.prompt_ids
        np.testing.assert_allclose(a.response_log_probs, b.response_log_probs, atol=atol, rtol=0)
        if b.routed_experts is not None:
            assert a.routed_experts.dtype == b.routed_experts.dtype
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def wait_for_tokens(engine: ProcessEngine, count: int, timeout_s: float = 60) -> None:
    """Poll the child's token counter until it reaches `count`."""
    wait_until(lambda: engine.generated_tokens >= count, timeout_s, f"{count} tokens generated", interval_s=0.005)


def wait_for_steady_tokens(engine: ProcessEngine, steady_s: float, timeout_s: float = 60) -> int:
    """The child's token count once it has not changed for `steady_s` (the decode step in flight at a pause has
    ended: nothing in the engine announces it)."""
    last = {"count": engine.generated_tokens, "since": time.monotonic()}

    def steady() -> bool:
        if (count := engine.generated_tokens) != last["count"]:
            last.update(count=count, since=time.monotonic())
        return time.monotonic() - last["since"] >= steady_s

    wait_until(steady, timeout_s, f"the token count to stay put for {steady_s:g} s", interval_s=0.05)
    return last["count"]


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_the_factory_runs_the_local_engine_in_a_child_in_async_mode(process_engine, tiny_dir: Path):
    assert isinstance(process_engine, ProcessEngine) and process_engine.pid != os.getpid()
    assert process_engine.weight_version == "step-0" and process_engine.healthy()
    cases = [("sync", "auto", "trainer"), ("async", "auto", "separate"), ("sync", "separate", "separate")]
    for mode, where, expected in [*cases, ("async", "trainer", "trainer")]:
        overrides = [f"trainer.mode={mode}", f"rollout.engine_process={where}"]
        cfg = load_config(None, [f"model.hf_path={tiny_dir}", *overrides])
        assert local_engine_process(cfg.rollout, asynchronous=cfg.trainer.mode == "async") == expected


def test_generate_matches_the_in_process_engine(process_engine: ProcessEngine, engine: LocalEngine):
    got = process_engine.generate(PROMPTS, SEEDED, n=2, return_routed_experts=True)
    assert_same_samples(got, engine.generate(PROMPTS, SEEDED, n=2, return_routed_experts=True))
    assert {s.weight_version for s in got} == {"step-0"}
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert_same_samples(process_engine.generate(PROMPTS, greedy), engine.generate(PROMPTS, greedy))
    with pytest.raises(ValueError, match="at least one token"):  # the child's error, raised here
        process_engine.generate([[]], SEEDED)


def test_score_prompts_matches_the_in_process_engine(process_engine: ProcessEngine, engine: LocalEngine):
    (got,) = process_engine.score_prompts(PROMPTS)
    (want,) = engine.score_prompts(PROMPTS)
    assert got.log_probs == want.log_probs and got.version == process_engine.weight_version


def test_update_weights_matches_the_in_process_update(process_engine, tiny_dir: Path, weights, other_weights):
    reference = LocalEngine(tiny_dir)
    buckets = [other_weights[:10], other_weights[10:]]
    reference.update_weights(buckets, version="v1")
    process_engine.update_weights(buckets, version="v1")
    assert process_engine.weight_version == "v1"
    got = process_engine.generate(PROMPTS, SEEDED, n=2, return_routed_experts=True)
    assert_same_samples(got, reference.generate(PROMPTS, SEEDED, n=2, return_routed_experts=True))
    assert {s.weight_version for s in got} == {"v1"}

    name, tensor = weights[0]
    with pytest.raises(WeightUpdateError, match=r"shape \(128, 63\).*expects \(128, 64\)"):
        process_engine.update_weights([[(name, tensor[:, :63])]], version="v2")
    assert process_engine.weight_version == "v1" and process_engine.healthy()  # nothing was loaded

    def failing_sender():
        yield weights[:5]
        raise OSError("export failed")

    with pytest.raises(OSError, match="export failed"):
        process_engine.update_weights(failing_sender(), version="v2")
    assert not process_engine.healthy() and process_engine.weight_version == "v1"  # half-loaded: visible
    assert process_engine.recover() == []  # alive: the caller's full update repairs it
    process_engine.update_weights([weights], version="v2")  # one bucket larger than the buffer: it grows
    assert process_engine.healthy() and process_engine.weight_version == "v2"
    with pytest.raises(WeightUpdateError, match=r"shape \(128, 63\)"):  # a bad bucket after a loaded one
        process_engine.update_weights([weights[:5], [(name, tensor[:, :63])], weights[5:]], version="v3")
    assert not process_engine.healthy() and process_engine.weight_version == "v2"
    process_engine.update_weights([weights[:9], weights[9:]], version="v2")
    assert process_engine.healthy()
    assert_same_samples(process_engine.generate(PROMPTS, SEEDED), LocalEngine(tiny_dir).generate(PROMPTS, SEEDED))


def test_an_update_during_a_generate_lands_between_decode_steps(process_engine: ProcessEngine, engine, weights):
    """Paused after some tokens, updated to the same values under a new version, resumed: the sample's tokens
    are the in-process engine's, and its weight-version spans split where the update landed."""
    before, start = process_engine.weight_version, process_engine.generated_tokens
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=0)
    thread, out = in_thread(lambda: process_engine.generate(PROMPTS[:1], params))
    wait_for_tokens(process_engine, start + 5)
    process_engine.pause()
    held = wait_for_steady_tokens(process_engine, 0.3)  # the step in flight ends
    assert thread.is_alive()
    process_engine.update_weights([weights[:7], weights[7:]], version="v3")
    process_engine.resume()
    thread.join(timeout=60)
    ((sample,),) = out
    assert sample.weight_version == "v3" and sample.finish_reason == "length"
    assert sample.metadata["weight_versions"] == [(before, 0, held - start + 1), ("v3", held - start + 1, 300)]
    assert_same_samples([sample], engine.generate(PROMPTS[:1], params))


def test_abort_ends_a_generate_in_flight_with_its_partial_tokens(process_engine: ProcessEngine):
    start = process_engine.generated_tokens
    params = SamplingParams(max_new_tokens=400, temperature=1.0, seed=0)
    thread, out = in_thread(lambda: process_engine.generate(PROMPTS, params, n=2, return_routed_experts=True))
    wait_for_tokens(process_engine, start + 6 * 3)
    process_engine.abort()
    thread.join(timeout=60)
    (samples,) = out
    assert len(samples) == 6
    for sample in samples:
        assert sample.finish_reason == "abort" and 0 < len(sample.response_ids) < 400
        assert len(sample.response_log_probs) == len(sample.response_ids)
        assert sample.routed_experts.shape[0] == len(sample.tokens) - 1
    after = process_engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert [s.finish_reason for s in after] == ["length"] * 3  # an abort ends only the calls in progress


def test_released_weights_refuse_generation_until_resumed_and_updated(process_engine: ProcessEngine, engine, weights):
    process_engine.release_memory(["weights"])
    with pytest.raises(RolloutEngineError, match=r"memory released"):  # the child's EngineMemory refusal
        process_engine.generate(PROMPTS, SEEDED)
    process_engine.resume_memory()
    with pytest.raises(RolloutEngineError, match="not updated since"):
        process_engine.generate(PROMPTS, SEEDED)
    process_engine.update_weights([weights], version="v5")
    assert_same_samples(process_engine.generate(PROMPTS, SEEDED), engine.generate(PROMPTS, SEEDED))


def test_a_killed_child_fails_calls_and_recover_restarts_it(process_engine: ProcessEngine, engine, weights):
    pid = process_engine.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RolloutEngineError, match=rf"local engine process \(pid {pid}\) was killed by signal 9"):
        process_engine.generate(PROMPTS, SEEDED)
    assert not process_engine.healthy()
    assert process_engine.recover() == ["local engine process"]
    assert process_engine.pid != pid and process_engine.healthy() and process_engine.weight_version == "step-0"
    process_engine.update_weights([weights], version="v4")  # the caller re-sends the weights
    got = process_engine.generate(PROMPTS, SEEDED, n=2, return_routed_experts=True)
    assert_same_samples(got, engine.generate(PROMPTS, SEEDED, n=2, return_routed_experts=True))
    assert {s.weight_version for s in got} == {"v4"}


def test_a_hung_child_times_out_and_recover_restarts_it(process_engine: ProcessEngine, engine):
    pid, timeout = process_engine.pid, process_engine.control_timeout_s
    os.kill(pid, signal.SIGSTOP)
    process_engine.control_timeout_s = 1.0
    try:
        errors: list[Exception] = []
        waiting = threading.Thread(target=lambda: _catch(errors, process_engine.generate, PROMPTS, SEEDED))
        waiting.start()  # a generate waits on the stopped child (its own timeout is 600 s)
        with pytest.raises(RolloutEngineError, match=rf"\(pid {pid}\) did not answer 'pause' within 1 s"):
            process_engine.pause()
        waiting.join(timeout=10)  # the timeout failed it too
        assert not waiting.is_alive() and "did not answer 'pause'" in str(errors[0])
        with pytest.raises(RolloutEngineError, match="did not answer"):  # no more waiting on it
            process_engine.generate(PROMPTS, SEEDED)
        assert not process_engine.healthy()
    finally:
        process_engine.control_timeout_s = timeout
    assert process_engine.recover() == ["local engine process"]
    assert process_engine.pid != pid and process_engine.healthy()
    assert_same_samples(process_engine.generate(PROMPTS, SEEDED), engine.generate(PROMPTS, SEEDED))


def test_a_child_that_cannot_build_its_engine_raises_its_error_and_is_reaped(tmp_path: Path):
    before = set(multiprocessing.active_children())
    with pytest.raises(OSError, match="missing"):  # transformers' own error, raised in the child
        ProcessEngine(tmp_path / "missing")
    assert set(multiprocessing.active_children()) == before


def test_the_child_exits_when_its_parent_dies(tiny_dir: Path):
    script = (
        "import os, signal, sys\n"
        "from megatron_rl.rollout.engines.engine_process import ProcessEngine\n"
        "if __name__ == '__main__':\n"
        f"    engine = ProcessEngine({str(tiny_dir)!r})\n"
        "    print(engine.pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    child = int(run.stdout.split()[-1])
    wait_until(lambda: not _running(child), 30, f"the engine process {child} to end with its parent", interval_s=0.1)


def test_shutdown_leaves_no_process_and_no_shared_memory(process_engine: ProcessEngine, shm_before: set[str]):
    pid = process_engine.pid
    process_engine.shutdown()
    assert not _running(pid) and not multiprocessing.active_children()
    assert not process_engine.healthy()
    with pytest.raises(RuntimeError, match="shut down"):
        process_engine.generate(PROMPTS, SEEDED)
    assert _shm_entries() <= shm_before


def _catch(errors: list[Exception], fn, *args) -> None:
    try:
        fn(*args)
    except Exception as err:
        errors.append(err)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
