"""The SGLang client against a REAL SGLang 0.5.23 server on CPU (tiny Qwen3-MoE, fp32).

Tests run in file order on one server: generation, log-probs and routed experts vs transformers, pause/abort,
the three weight-sync paths (each loads a different random model; served log-probs must then match it),
and finally crash (kill -9) -> clear error within the timeout -> restart -> works again.
The server runs with the API key the launch gives it (SGLang's --api-key): every test above works with it, a
request without it or with a wrong one is refused, and the key shows in no command line and no log.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.sglang.distributed_weight_sync import DistributedWeightSync
from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServerError, SGLangServers, request_json
from megatron_rl.rollout.sglang.weight_sync import DiskWeightSync, TensorWeightSync
from megatron_rl.rollout.sync_probe import ProbeTolerance, compare_probe
from tests.waiting import wait_until

pytestmark = pytest.mark.sglang

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 60, 70], [1, 99]]
LOGPROB_ATOL = 2e-3  # fp32 torch_native attention vs transformers eager
REPORT: dict[str, object] = {}


class HFReference:
    """Teacher-forced log-probs and router top-k of a checkpoint with transformers (the "trainer's view")."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.routers = [m for n, m in self.model.named_modules() if n.endswith(".gate") and hasattr(m, "top_k")]

    @torch.inference_mode()
    def run(self, tokens: list[int]) -> tuple[list[float], np.ndarray]:
        sink: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda m, i, o: sink.append(o[2])) for r in self.routers]
        try:
            logits = self.model(torch.tensor([tokens])).logits[0].float()
        finally:
            for h in hooks:
                h.remove()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        routes = torch.stack([s.reshape(len(tokens), -1) for s in sink], dim=1)  # [T, layers, k]
        return lp.tolist(), routes[:-1].numpy()


def hf_buckets(model_dir: Path, bucket_bytes: int = 64 << 10) -> list[list[tuple[str, torch.Tensor]]]:
    """The checkpoint's tensors in HF names, bucketed like `MegatronActor.export_hf(bucket_bytes=...)`."""
    from safetensors.torch import load_file

    buckets, current, size = [], [], 0
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if current and size + t.numel() * t.element_size() > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += t.numel() * t.element_size()
    return [*buckets, current] if current else buckets


@pytest.fixture(scope="module")
def servers(sglang_py: str, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    config = SGLangLaunchConfig(
        model_path=str(tiny_models["a"]),
        python=sglang_py,
        extra_args=CPU_SERVER_ARGS,
        env=cpu_launch_env(),
        log_dir=str(tmp_path_factory.mktemp("sglang_logs")),
        startup_timeout_s=240,
    )
    start = time.perf_counter()
    with SGLangServers.launch(config) as servers:
        REPORT["startup_s"] = time.perf_counter() - start
        yield servers
    print("\nSGLANG TIER REPORT:", REPORT)


@pytest.fixture(scope="module")
def engine(servers: SGLangServers) -> SGLangEngine:
    return SGLangEngine(servers, request_timeout_s=60, control_timeout_s=30)


def test_generate_greedy_matches_transformers(engine: SGLangEngine, tiny_models):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    samples = engine.generate(PROMPTS, params, n=2)
    assert len(samples) == 2 * len(PROMPTS)
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2]
    ref = HFReference(tiny_models["a"])
    for s in samples:
        assert s.prompt_ids == PROMPTS[s.group_index]
        assert s.finish_reason in ("stop", "length")
        assert s.weight_version == "default"
        assert len(s.response_ids) == len(s.response_log_probs) > 0
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == 2  # EOS kept in the response
        # greedy: each response token is transformers' argmax given the prefix
        with torch.inference_mode():
            logits = ref.model(torch.tensor([s.tokens])).logits[0]
        argmax = logits[len(s.prompt_ids) - 1 : -1].argmax(-1).tolist()
        assert argmax == s.response_ids


def test_sampling_n_seed_and_stop_tokens(engine: SGLangEngine):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, stop_token_ids=(50, 51, 52))
    samples = engine.generate([PROMPTS[0]], params, n=4)
    assert len(samples) == 4 and {s.group_index for s in samples} == {0}
    for s in samples:
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in (2, 50, 51, 52)
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 16


def test_logprobs_match_transformers_teacher_forced(engine: SGLangEngine, tiny_models):
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)  # T=1, no top-k/p: plain log-softmax
    samples = engine.generate(PROMPTS, params, n=2)
    ref = HFReference(tiny_models["a"])
    diffs = []
    for s in samples:
        lp, _ = ref.run(s.tokens)
        diffs.extend(abs(a - b) for a, b in zip(s.response_log_probs, lp[len(s.prompt_ids) - 1 :], strict=True))
    REPORT["mean_abs_dlogprob"] = float(np.mean(diffs))
    REPORT["max_abs_dlogprob"] = float(np.max(diffs))
    assert np.max(diffs) < LOGPROB_ATOL, (np.mean(diffs), np.max(diffs))


def test_routed_experts_match_transformers_router(engine: SGLangEngine, tiny_models):
    samples = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=10, temperature=1.0, seed=1), return_routed_experts=True
    )
    ref = HFReference(tiny_models["a"])
    for s in samples:
        assert s.routed_experts is not None and s.routed_experts.dtype == np.uint8
        assert s.routed_experts.shape == (len(s.tokens) - 1, 2, 2)
        _, routes = ref.run(s.tokens)
        # top-k sets per position and layer (order within the top-k is not part of the contract)
        np.testing.assert_array_equal(np.sort(s.routed_experts, -1), np.sort(routes, -1))


def test_throughput(engine: SGLangEngine):
    prompts = [[1, 10 + i, 20 + i] for i in range(8)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=0)
    engine.generate(prompts[:1], params)
    start, before = time.perf_counter(), engine.generated_tokens
    samples = engine.generate(prompts, params, n=2)
    seconds = time.perf_counter() - start
    generated = engine.generated_tokens - before
    REPORT["tokens_per_s_bs16"] = generated / seconds
    assert [s.group_index for s in samples] == [i // 2 for i in range(16)]
    assert generated == sum(len(s.response_ids) for s in samples) > 16  # the counter the rate is made of
    assert all(s.finish_reason in ("stop", "length") for s in samples)


def _held_requests(servers: SGLangServers) -> int:
    """The requests SGLang's scheduler holds (running or waiting), from `/v1/loads`."""
    (load,) = request_json(servers.urls[0], "/v1/loads?include=core", timeout_s=10, api_key=servers.api_key)["loads"]
    return load["num_running_reqs"] + load["num_waiting_reqs"]


def _wait_until_held(servers: SGLangServers) -> None:
    """Poll SGLang's `/v1/loads` until the server holds a request; the deadline only bounds a failure."""
    wait_until(lambda: _held_requests(servers) > 0, 60, "the server to hold a request", interval_s=0.05)


def _log_requests(servers: SGLangServers, on: bool) -> None:
    """Switch SGLang's request log on or off (`/configure_logging`): it logs "Receive: obj=..." for each request
    as it arrives, before the pause gate."""
    body = {"log_requests": on, "log_requests_level": 0}
    request_json(servers.urls[0], "/configure_logging", body, timeout_s=10, api_key=servers.api_key)


def test_abort_and_pause(servers: SGLangServers, engine: SGLangEngine):
    no_eos = SGLangEngine(servers, request_timeout_s=60, control_timeout_s=30, stop_on_eos=False)
    params = SamplingParams(max_new_tokens=240, temperature=1.0)
    long_prompts = [[1, 5, 6]] * 12
    result: list = []
    worker = threading.Thread(target=lambda: result.extend(no_eos.generate(long_prompts, params)))
    worker.start()
    _wait_until_held(servers)  # generation is under way
    start = time.perf_counter()
    engine.abort()
    worker.join(60)
    REPORT["abort_return_s"] = time.perf_counter() - start
    assert not worker.is_alive()
    assert len(result) == 12
    assert any(s.finish_reason == "abort" for s in result), [s.finish_reason for s in result]
    # pause (retract) holds requests; resume lets them finish normally
    (log,) = Path(servers.config.log_dir).glob("sglang_0_*.log")
    engine.pause()
    try:
        _log_requests(servers, True)
        received = log.read_text(errors="replace").count("Receive: obj=")
        worker = threading.Thread(target=lambda: result.extend(engine.generate([[1, 7]], SamplingParams(8, 0.0))))
        worker.start()
        # A request that arrives during a pause waits at the pause gate of SGLang's tokenizer manager, just after
        # its receipt is logged: it is there once the log shows it, not answered and not in the scheduler.
        wait_until(lambda: log.read_text(errors="replace").count("Receive: obj=") > received, 60,
                   "the server to log the receipt of the request sent during the pause", interval_s=0.05)  # fmt: skip
        assert _held_requests(servers) == 0 and worker.is_alive()
    finally:
        _log_requests(servers, False)
        engine.resume()
    worker.join(60)
    assert result[-1].finish_reason in ("stop", "length")
    assert engine.healthy()


PROBE = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


def _sync_and_check(engine: SGLangEngine, sync, model_dir: Path, version: str) -> None:
    before = engine.score_prompts([PROBE])[0].log_probs[0]
    engine.weight_sync = sync
    engine.update_weights(hf_buckets(model_dir), version)
    expected, _ = HFReference(model_dir).run(PROBE)
    assert max(abs(a - b) for a, b in zip(before, expected, strict=True)) > 0.05  # the probe can tell them apart
    (served,) = engine.score_prompts([PROBE])  # the version the server reports, and its log-probs of the probe
    diff = compare_probe([expected], served, version, ProbeTolerance(LOGPROB_ATOL, LOGPROB_ATOL)).max_abs
    report = engine.last_sync
    REPORT[f"sync_{report.path}"] = (
        f"{report.bytes} B, {report.buckets} buckets, {report.seconds:.2f} s, max dlp {diff:.1e}"
    )
    samples = engine.generate([PROBE], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert samples[0].weight_version == version == engine.weight_version


def test_weight_sync_tensor(engine: SGLangEngine, tiny_models):
    _sync_and_check(engine, TensorWeightSync(), tiny_models["b"], "v1-tensor")


def test_weight_sync_distributed_gloo(engine: SGLangEngine, tiny_models):
    sync = DistributedWeightSync(backend="gloo")
    try:
        _sync_and_check(engine, sync, tiny_models["c"], "v2-distributed")
    finally:
        sync.close()


def test_weight_sync_disk(engine: SGLangEngine, tiny_models, tmp_path):
    _sync_and_check(engine, DiskWeightSync(directory=str(tmp_path / "ckpt")), tiny_models["d"], "v3-disk")


def test_weight_sync_disk_temporary_directories_twice(engine: SGLangEngine, tiny_models):
    """Each update writes a fresh temporary directory and deletes it afterwards; the server then reports that
    deleted directory as its model_path, so the second update must not read its config files from there."""
    sync = DiskWeightSync()
    _sync_and_check(engine, sync, tiny_models["b"], "v4-disk-tmp")
    _sync_and_check(engine, sync, tiny_models["d"], "v5-disk-tmp")


def _status(url: str, path: str, body: dict | None, key: str | None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_requests_without_or_with_a_wrong_key_are_refused(servers: SGLangServers, tiny_models):
    url = servers.urls[0]
    calls = {
        "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
        "/update_weights_from_disk": {"model_path": str(tiny_models["b"])},
        "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                       "world_size": 2, "group_name": "intruder", "backend": "gloo"},
        "/update_weights_from_tensor": {"serialized_named_tensors": []},
        "/pause_generation": {"mode": "abort"},
        "/server_info": None,
    }  # fmt: skip
    for path, body in calls.items():
        for key in (None, "wrong-" + servers.api_key):
            assert _status(url, path, body, key) == 401, (path, key is None)
    assert _status(url, "/health", None, None) == 200  # SGLang leaves health probes open
    with pytest.raises(SGLangServerError, match="HTTP 401"):
        SGLangEngine([url], request_timeout_s=30).generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert _status(url, "/generate", calls["/generate"], servers.api_key) == 200


def test_router_in_front(servers: SGLangServers):
    """A router that does not start fails this test: the `sglang` tier installs sglang-router."""
    try:
        start = time.perf_counter()
        servers.start_router()
        REPORT["router_start_s"] = time.perf_counter() - start
        via_router = SGLangEngine(servers, request_timeout_s=60)
        direct = SGLangEngine(SGLangServers.connect(servers.urls, api_key=servers.api_key), request_timeout_s=60)
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        assert _status(servers.router_url, "/generate", body, None) == 401  # the router checks the key too
        assert _status(servers.router_url, "/generate", body, "wrong") == 401
        params = SamplingParams(max_new_tokens=6, temperature=0.0)
        assert [s.response_ids for s in via_router.generate(PROMPTS, params)] == [
            s.response_ids for s in direct.generate(PROMPTS, params)
        ]
    finally:
        servers.stop_router()


def _group_cmdlines(leader: int) -> list[str]:
    """Command lines of every process in `leader`'s process group (the server and its scheduler processes)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == leader:
                out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ProcessLookupError):
            pass
    return out


def test_the_key_is_on_no_command_line_and_in_no_log(servers: SGLangServers):
    key = servers.api_key
    assert stat.S_IMODE(servers.api_key_file.stat().st_mode) == 0o600
    cmdlines = _group_cmdlines(servers._procs[0].pid)
    assert len(cmdlines) >= 2 and not any(key in c for c in cmdlines), cmdlines
    assert key not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    logs = [p for p in Path(servers.config.log_dir).iterdir() if p != servers.api_key_file]
    for log in logs:
        assert stat.S_IMODE(log.stat().st_mode) == 0o600, log
        assert key not in log.read_text(errors="replace"), log
    server_log = next(p for p in logs if p.name.startswith("sglang_0_")).read_text()
    assert "'api_key': '<redacted>'" in server_log  # SGLang logs its arguments; the launcher redacts the key


def test_crash_clear_error_then_restart(servers: SGLangServers, tiny_models):
    engine = SGLangEngine(servers, request_timeout_s=10, control_timeout_s=5)
    servers.kill(0)
    servers._procs[0].wait(30)  # the server's process is gone
    start = time.perf_counter()
    with pytest.raises(SGLangServerError, match="unreachable|did not answer"):
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert time.perf_counter() - start < 15
    assert not engine.healthy()
    start = time.perf_counter()
    servers.restart(0)
    REPORT["restart_s"] = time.perf_counter() - start
    samples = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert samples[0].finish_reason in ("stop", "length") and engine.healthy()
