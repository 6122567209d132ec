"""Verified weight syncs against a real CPU SGLang server (fp32): a healthy sync passes the probe, and a sync after
which the server computes with one perturbed expert (the layer-0 expert the probe's prompt tokens are routed to
most, read from the server's own routes) stops the run with the message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env

from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers
from megatron_rl.rollout.sync_probe import TOLERANCES
from megatron_rl.tiny_model import make_tiny_qwen3_moe

pytestmark = pytest.mark.sglang
REPO = Path(__file__).parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "train_sglang_probe.py"


def test_a_sync_whose_server_computes_with_a_perturbed_expert_stops_the_run(sglang_py: str, tmp_path: Path) -> None:
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=1234)
    launch = SGLangLaunchConfig(
        model_path=str(model),
        python=sglang_py,
        extra_args=CPU_SERVER_ARGS,
        env=cpu_launch_env(),
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=600,
    )
    perturbed = tmp_path / "perturbed.json"
    with SGLangServers.launch(launch) as servers:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "train", str(REPO / "examples" / "tiny_moe_gspo.yaml"),
             f"trainer.output_dir={tmp_path / 'run'}", f"model.hf_path={model}", "rollout.engine=sglang",
             f"rollout.sglang.urls=[{servers.urls[0]}]", f"rollout.sglang.api_key_file={servers.api_key_file}",
             "warmup.sft_steps=0", "trainer.steps=3", "rollout.verify_sync_every=1", "rollout.prompts_per_step=4",
             "rollout.n_samples=2", "data.eval=null", "data.eval_every=0", "trainer.save_every=0",
             "logging.wandb=false", "logging.plot=false"],
            capture_output=True, text=True, timeout=1200,
            env={**os.environ, "PERTURB_AT": "step-2", "PERTURBED": str(perturbed), "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-4000:]
    record = json.loads(perturbed.read_text())
    assert record["version"] == "step-2" and record["routed_tokens"] > 0  # the probe's tokens use that expert
    (message,) = [line for line in proc.stderr.splitlines() if line.startswith("megatron-rl train: stopped: ")]
    assert f"weight sync to version 'step-2' did not take effect on {servers.urls[0]}" in message
    tol = TOLERANCES["float32"]
    for part in ("max |dlogp| = ", f"tolerance for float32: max {tol.max_abs:g}", "re-lays out", "TP/EP merge"):
        assert part in message, part
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1]  # step 1's syncs (start-up and its own) were verified healthy
    assert history[0]["sync/probe_logp_diff_max"] <= tol.max_abs
