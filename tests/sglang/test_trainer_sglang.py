"""`megatron-rl train` with real SGLang rollout servers (CPU, test shims), and R3 against no replay.

The trainer connects to servers launched here (`rollout.sglang.urls`), syncs the warmed-up weights into them
(tensor path) and after every step. Measured: trainer-vs-rollout log-prob mismatch with routing replay off and R3
when the server computes in bf16 and the trainer in fp32 (routes then differ between the two).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env

from megatron_rl.rollout.sglang_server import SGLangLaunchConfig, SGLangServers
from megatron_rl.tiny_model import make_tiny_qwen3_moe

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


def _train(out: Path, model_dir: Path, url: str, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
        f"model.hf_path={model_dir}", "rollout.engine=sglang", f"rollout.sglang.urls=[{url}]",
        "rollout.weight_sync=tensor", "trainer.colocate=true", "warmup.sft_steps=100", "warmup.sft_batch_size=32",
        "warmup.sft_lr=2e-3", "optimizer.lr=1e-4", "trainer.steps=3", "data.eval=null", "data.eval_every=0",
        "trainer.save_every=0", "logging.wandb=false", "logging.plot=false", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_with_sglang_fp32(sglang_py: str, model_dir: Path, tmp_path: Path) -> None:
    with _launch(sglang_py, model_dir, "float32", tmp_path / "logs") as servers:
        history = _train(tmp_path / "run", model_dir, servers.urls[0])
    assert len(history) == 3
    for r in history:
        assert r["actor/ppo_kl_first"] == 0.0
        # Same fp32 weights on both sides (synced after warm-up and every step): only kernel differences remain.
        assert r["mismatch/logp_abs_diff"] < 1e-3, r["mismatch/logp_abs_diff"]
    assert any(r["rollout/reward_mean"] > 0 for r in history)  # the warmed-up weights reached the server


def test_r3_against_no_replay_with_bf16_server(sglang_py: str, model_dir: Path, tmp_path: Path) -> None:
    results = {}
    with _launch(sglang_py, model_dir, "bfloat16", tmp_path / "logs") as servers:
        for mode in ("off", "R3"):
            history = _train(tmp_path / mode, model_dir, servers.urls[0], "algo.preset=grpo",
                             f"algo.routing_replay={mode}", "algo.kl_coef=0")  # fmt: skip
            results[mode] = {
                "logp_abs_diff": sum(r["mismatch/logp_abs_diff"] for r in history) / len(history),
                "k3_kl": sum(r["mismatch/k3_kl"] for r in history) / len(history),
                "rollout_agreement": [r.get("routing/rollout_agreement") for r in history],
            }
    print("\nR3 VS OFF (bf16 server, fp32 trainer):", json.dumps(results))
    assert results["R3"]["logp_abs_diff"] <= results["off"]["logp_abs_diff"] * 1.05
    assert all(a is not None and 0.5 < a <= 1.0 for a in results["R3"]["rollout_agreement"])
