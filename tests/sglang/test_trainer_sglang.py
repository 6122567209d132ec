"""`megatron-rl train` with real SGLang rollout servers (CPU, test shims), and R3 against no replay.

The trainer connects to servers launched here (`rollout.sglang.urls`, their API key through
`rollout.sglang.api_key_file`), syncs the warmed-up weights into them (tensor path) and after every step; the key
shows in none of the run's files or its output. Measured: trainer-vs-rollout log-prob mismatch with routing replay
off and R3 when the server computes in bf16 and the trainer in fp32 (routes then differ between the two).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env

from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers
from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.waiting import wait_until

pytestmark = pytest.mark.sglang
EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_moe_gspo.yaml"


def _server_args(dtype: str) -> tuple[str, ...]:
    args = list(CPU_SERVER_ARGS)
    args[args.index("--dtype") + 1] = dtype
    return tuple(args)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("trainer_sglang") / "model", seed=1234)


def _launch(sglang_py: str, model_dir: Path, dtype: str, log_dir: Path) -> SGLangServers:
    return SGLangServers.launch(
        SGLangLaunchConfig(
            model_path=str(model_dir),
            python=sglang_py,
            extra_args=_server_args(dtype),
            env=cpu_launch_env(),
            log_dir=str(log_dir),
            startup_timeout_s=240,
        )
    )


def _assert_secret_absent(secret: str, out: Path, *texts: str) -> None:
    """`secret` is in no file of the run folder (config.yaml, metrics.jsonl, logs, ...) but its key file, and in
    none of `texts` (the run's output)."""
    for path in out.rglob("*"):
        if path.is_file() and path.name != ".rollout_api_key":
            assert secret.encode() not in path.read_bytes(), path
    for text in texts:
        assert secret not in text


def _train(
    out: Path, model_dir: Path, url: str, *overrides: str, api_key: tuple[Path, str] | None = None
) -> list[dict]:
    cmd = [
        sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
        f"model.hf_path={model_dir}", "rollout.engine=sglang", f"rollout.sglang.urls=[{url}]",
        "warmup.sft_steps=100", "warmup.sft_batch_size=32",
        "warmup.sft_lr=2e-3", "optimizer.lr=1e-4", "trainer.steps=3", "data.eval=null", "data.eval_every=0",
        "trainer.save_every=0", "logging.wandb=false", "logging.plot=false", *overrides,
    ]  # fmt: skip
    if api_key is not None:
        cmd.append(f"rollout.sglang.api_key_file={api_key[0]}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if api_key is not None:
        assert str(api_key[0]) in (out / "config.yaml").read_text()  # the file's path is recorded, not the key
        _assert_secret_absent(api_key[1], out, proc.stdout, proc.stderr)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "sync", [("rollout.weight_sync=tensor", "trainer.colocate=true"),
             ("rollout.weight_sync=distributed", "trainer.colocate=false")],
    ids=["colocated-tensor", "disaggregated-broadcast"],
)  # fmt: skip
def test_train_with_sglang_fp32(sglang_py: str, model_dir: Path, tmp_path: Path, sync: tuple[str, str]) -> None:
    with _launch(sglang_py, model_dir, "float32", tmp_path / "logs") as servers:
        history = _train(
            tmp_path / "run", model_dir, servers.urls[0], *sync, api_key=(servers.api_key_file, servers.api_key)
        )
        for log in (tmp_path / "logs").glob("sglang_*.log"):
            assert servers.api_key not in log.read_text(errors="replace")
    assert len(history) == 3
    for r in history:
        assert r["actor/ppo_kl_first"] == 0.0
        # Same fp32 weights on both sides (synced after warm-up and every step): only kernel differences remain.
        assert r["mismatch/logp_abs_diff"] < 1e-3, r["mismatch/logp_abs_diff"]
    assert any(r["rollout/reward_mean"] > 0 for r in history)  # the warmed-up weights reached the server


@pytest.fixture(scope="module")
def fp32_server(sglang_py: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One fp32 server for the runs below: each run syncs its own warmed-up weights into it first."""
    with _launch(sglang_py, model_dir, "float32", tmp_path_factory.mktemp("fp32_server_logs")) as servers:
        yield servers


@pytest.mark.parametrize("partial", [False, True], ids=["async", "async+partial"])
def test_async_training_with_a_disaggregated_server(
    fp32_server: SGLangServers, model_dir: Path, tmp_path: Path, partial: bool
) -> None:
    """trainer.mode=async against a real server (P15): the producer's requests go over HTTP while the trainer
    trains; weight updates reach the server between requests (or abort and continue them: rollout.partial), and
    every sample comes back stamped with the version that generated it, at most one behind."""
    servers = fp32_server
    history = _train(
        tmp_path / "run", model_dir, servers.urls[0], "rollout.weight_sync=distributed", "trainer.colocate=false",
        "trainer.mode=async", f"rollout.partial={str(partial).lower()}", "trainer.steps=4",
        api_key=(servers.api_key_file, servers.api_key),
    )  # fmt: skip
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    for r in history:
        assert r["actor/ppo_kl_first"] == 0.0 and r["async/staleness_max"] <= 1.0
        if not partial:
            assert r["async/staleness_mean"] == (0.0 if r["step"] == 1 else 1.0)
        assert "actor/rollout_is_weight_mean" in r  # TIS is on by default in async mode
    assert any(r["rollout/reward_mean"] > 0 for r in history)


def test_multi_turn_training_with_a_server(fp32_server: SGLangServers, model_dir: Path, tmp_path: Path) -> None:
    """Multi-turn rollouts (P16) through a real server, R3 on: each turn is a request whose prefix comes from the
    radix cache; the trainer scores the final sequences with the server's routes replayed, on-policy."""
    servers = fp32_server
    history = _train(
        tmp_path / "run", model_dir, servers.urls[0], "rollout.env=tests.trainer.multi_turn_env:AckEnv",
        "rollout.env_options={turns: 3}", "rollout.turns.max_tokens=48", "algo.routing_replay=R3",
        api_key=(servers.api_key_file, servers.api_key),
    )  # fmt: skip
    assert len(history) == 3
    for r in history:
        assert r["actor/ppo_kl_first"] == 0.0
        assert r["multi_turn/turns_mean"] > 2.0 and r["multi_turn/observation_token_share"] > 0.1
        # fp32 on both sides, the server's routes replayed: kernel differences only, over every turn.
        assert r["mismatch/logp_abs_diff"] < 1e-3, r["mismatch/logp_abs_diff"]
        assert r["routing/rollout_agreement"] > 0.99


def test_evaluation_with_a_server(fp32_server: SGLangServers, model_dir: Path, tmp_path: Path) -> None:
    """P18 on a real server: two evaluation datasets (greedy; 4 samples per prompt) scored at steps 0 and 2, and
    `megatron-rl eval` of the step-2 checkpoint against the same server reproduces the greedy numbers."""
    servers = fp32_server
    out = tmp_path / "run"
    evals = ("data.eval=[{name: greedy, path: synthetic, prompts: 16},"
             " {name: sampled, path: synthetic, n_samples: 4, temperature: 1.0, prompts: 16}]")  # fmt: skip
    key = f"rollout.sglang.api_key_file={servers.api_key_file}"
    history = _train(out, model_dir, servers.urls[0], evals, "data.eval_every=2", "trainer.steps=2", key)
    by_step = {r["step"]: r for r in history}
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    for step in (0, 2):
        sampled = [r for r in rows if r["step"] == step and r["dataset"] == "sampled"]
        assert len(sampled) == 64
        assert by_step[step]["eval/sampled/mean@4"] == sum(r["reward"] > 0.5 for r in sampled) / 64
        groups = {g: {r["response"] for r in sampled if r["group"] == g} for g in range(16)}
        assert sum(len(texts) > 1 for texts in groups.values()) >= 4  # a prompt's 4 samples are not one copy
        assert by_step[step]["eval/sampled/pass@4"] >= by_step[step]["eval/sampled/pass@1"]
    assert by_step[0]["eval/greedy/accuracy"] > 0  # the warmed-up weights reached the server before step 0
    cmd = [sys.executable, "-m", "megatron_rl.cli", "eval", str(out / "config.yaml"), "--checkpoint", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    again = json.loads((out / "eval" / "step_000000002" / "eval_results.json").read_text())["metrics"]
    greedy = [k for k in again if k.startswith("eval/greedy/")]
    assert {k: again[k] for k in greedy} == {k: by_step[2][k] for k in greedy}


@pytest.mark.torchrun
def test_r3_replay_against_natural_routing_on_the_same_samples(sglang_py: str, model_dir: Path, tmp_path: Path) -> None:
    """The bf16 server's samples scored by the fp32 trainer with natural routing and with R3 replay.

    Same tokens on both sides, so the difference is only the routing: where bf16 serving flipped a route,
    natural routing adds a large log-prob error that replay removes. Measured here (1402 tokens): route
    agreement 0.9975, mean |Δ| 3.0e-3 -> 2.8e-3, max |Δ| 6.2e-2 -> 1.3e-2, k3 KL 1.05e-5 -> 6.4e-6."""
    import pickle

    from megatron_rl.config.sampling import SamplingParams
    from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
    from megatron_rl.tiny_model import build_char_tokenizer
    from tests.dist_harness import run_torchrun

    tokenizer = build_char_tokenizer()
    prompts = [tokenizer(f"{n:05d}>", add_special_tokens=False)["input_ids"] for n in range(10417, 10417 + 16 * 7, 7)]
    with _launch(sglang_py, model_dir, "bfloat16", tmp_path / "logs") as servers:
        engine = SGLangEngine(servers, request_timeout_s=120)
        samples = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=5), n=4, return_routed_experts=True)
    (tmp_path / "samples.pkl").write_bytes(pickle.dumps(samples))
    out = tmp_path / "ab.json"
    run_torchrun(Path(__file__).parent / "scripts" / "r3_ab.py", 1, [str(model_dir), str(tmp_path / "samples.pkl"),
                 str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    print("\nR3 A/B (bf16 SGLang server, fp32 trainer, same samples):", json.dumps(result))
    assert result["tokens"] > 500
    agreement = result["engine_vs_trainer_route_agreement"]["agreement"]
    assert 0.9 < agreement < 1.0, "bf16 serving should flip some routes of the fp32 trainer"
    for mode in ("off", "R3"):
        assert 0.0 < result[mode]["logp_abs_diff"] < 0.1
    assert result["R3"]["k3_kl"] < result["off"]["k3_kl"]
    assert result["R3"]["logp_abs_diff_max"] <= result["off"]["logp_abs_diff_max"]


def test_trainer_restarts_a_killed_server_and_finishes(sglang_py: str, model_dir: Path, tmp_path: Path) -> None:
    """The trainer launches its own server; it is SIGKILLed after step 1. The run restarts it, re-sends the
    current weights, retries the rollout and finishes every step."""
    import contextlib
    import os
    import signal

    from sglang_cpu_support import cpu_python_wrapper

    from megatron_rl.rollout.sglang.sglang_server import free_port

    wrapper = cpu_python_wrapper(tmp_path / "sglang_python", sglang_py)  # the servers' environment only
    port, out = free_port(), tmp_path / "run"
    cmd = [
        sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
        f"model.hf_path={model_dir}", "rollout.engine=sglang", f"rollout.sglang.python={wrapper}",
        f"rollout.sglang.base_port={port}", f"rollout.sglang.extra_args=[{','.join(CPU_SERVER_ARGS)}]",
        "rollout.sglang.startup_timeout_s=300", "rollout.sglang.request_timeout_s=120",
        "warmup.sft_steps=20", "trainer.steps=3", "data.eval=null", "data.eval_every=0", "trainer.save_every=0",
        "logging.wandb=false", "logging.plot=false",
    ]  # fmt: skip
    metrics = out / "metrics.jsonl"

    def logged() -> bool:
        return metrics.exists() and bool(metrics.read_text().strip())

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        with contextlib.suppress(AssertionError):  # a stall fails just below, with the run's output
            wait_until(lambda: logged() or proc.poll() is not None, 600, "step 1", interval_s=0.5)
        if not logged():
            proc.kill()
            pytest.fail(f"the run ended or stalled before step 1:\n{proc.communicate()[0][-6000:]}")
        pids = subprocess.run(["pgrep", "-f", f"sglang.launch_server.*--port {port}"], capture_output=True, text=True)
        pid = int(pids.stdout.split()[0])
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # the server and its scheduler processes
        output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-4000:]
    key_file = out / ".rollout_api_key"  # the run's own key, made at launch (rollout.sglang.api_key_file=null)
    assert (key_file.stat().st_mode & 0o777) == 0o600
    _assert_secret_absent(key_file.read_text().strip(), out, output)  # config.yaml, metrics, sglang_logs/
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3]
    assert sum(r["rollout/restarts"] for r in history) == 1, [r["rollout/restarts"] for r in history]
    assert "restarted ['http://127.0.0.1:" in output
    for r in history:
        assert r["actor/ppo_kl_first"] == 0.0
        assert r["mismatch/logp_abs_diff"] < 1e-3  # the restarted server got the current weights back


@pytest.mark.torchrun
def test_sglang_serves_an_exported_rl_checkpoint(sglang_py: str, model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint written by the trainer's checkpoint code after RL updates, exported with `megatron-rl
    convert megatron-to-hf`, served by the real SGLang server: its teacher-forced log-probs match the
    trainer's own scoring of the checkpoint."""
    from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
    from tests.dist_harness import run_torchrun

    repo = Path(__file__).parents[2]
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    train_args = ["--model", str(model_dir), "--ckpt", str(ckpt), "--out", str(tmp_path / "r.json"), "--phase", "full"]
    run_torchrun(repo / "tests" / "megatron_backend" / "checkpoint" / "scripts" / "checkpoint_check.py", 1, train_args)
    cli = [sys.executable, "-m", "megatron_rl.cli"]
    export_args = ["convert", "megatron-to-hf", str(ckpt), str(exported), "--hf-extras", str(model_dir)]
    convert = subprocess.run([*cli, *export_args], capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stderr[-3000:]
    ids = [5, 17, 33, 2, 60, 61, 9, 12, 40, 41, 42, 7]
    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": ids, "response_start": 1}) + "\n")
    score_args = ["logprobs", "--checkpoint", str(ckpt), "--input", str(tmp_path / "in.jsonl"), "--output",
                  str(tmp_path / "out.jsonl")]  # fmt: skip
    score = subprocess.run([*cli, *score_args], capture_output=True, text=True, timeout=300)
    assert score.returncode == 0, score.stderr[-3000:]
    trainer = json.loads((tmp_path / "out.jsonl").read_text())["log_probs"]
    with _launch(sglang_py, exported, "float32", tmp_path / "logs") as servers:
        (served,) = SGLangEngine(servers, request_timeout_s=120).score_prompts([ids])[0].log_probs
    worst = max(abs(a - b) for a, b in zip(served, trainer, strict=True))
    print(f"\nexported checkpoint: SGLang vs trainer max |Δ log-prob| = {worst:.2e} over {len(ids) - 1} tokens")
    assert worst < 1e-3
