"""End to end: a run whose reward always raises stops at its first step with exit code 2 and one clear line."""

from __future__ import annotations

import subprocess
from pathlib import Path

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.shared_runs import DEMO_SEED, TRAIN


def test_a_reward_that_always_raises_stops_the_run(tmp_path: Path) -> None:
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=DEMO_SEED)
    proc = subprocess.run(
        [
            *TRAIN,
            "trainer.steps=2",
            "warmup.sft_steps=0",
            "data.reward=tests.rollout.reward_fixtures:always_raises",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"model.hf_path={model}",
            "data.eval=null",
            "data.eval_every=0",
            "logging.wandb=false",
            "logging.plot=false",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("megatron-rl train: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert (
        "reward 'tests.rollout.reward_fixtures:always_raises' failed on 64 of 64 samples of a batch" in errors[0]
        and "more than data.reward_failure_limit=0.1" in errors[0]
        and "the first: KeyError: 'ground_truth' on the sample with prompt" in errors[0]
        and "Fix the function, or raise data.reward_failure_limit" in errors[0]
    ), errors[0]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # it stopped before training a step
