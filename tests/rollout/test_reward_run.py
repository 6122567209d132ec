"""End to end: a run whose reward fails beyond data.reward_failure_limit, in a rollout or in an evaluation, stops with
exit code 2 and one clear line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.shared_runs import DEMO_SEED, TRAIN

REPO = Path(__file__).parents[2]


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=DEMO_SEED)
    return subprocess.run(
        [
            *TRAIN,
            "warmup.sft_steps=0",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"model.hf_path={model}",
            "logging.wandb=false",
            "logging.plot=false",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,  # `tests.rollout.reward_fixtures` imports from the repository root
    )


def test_a_reward_that_always_raises_stops_the_run(tmp_path: Path) -> None:
    proc = _train(
        tmp_path,
        "trainer.steps=2",
        "data.reward=tests.rollout.reward_fixtures:always_raises",
        "data.eval=null",
        "data.eval_every=0",
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


def test_the_limit_applies_to_evaluation(tmp_path: Path) -> None:
    rows = [{"prompt": digits, "answer": digits[::-1], "split": "eval"} for digits in ("123", "4567", "890", "2468")]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = _train(
        tmp_path,
        "trainer.steps=1",
        "data.reward=tests.rollout.reward_fixtures:raises_on_eval",
        f"data.eval={eval_file}",
        "data.eval_every=1",
        "data.eval_prompts=4",
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (
        "megatron-rl train: error: reward 'tests.rollout.reward_fixtures:raises_on_eval' failed on 4 of 4 samples"
        in proc.stderr
    ), proc.stderr[-3000:]
    # 4 of 4: the evaluation's batch (a rollout scores 64), stopped by its first error.
    assert "the first: ValueError: no scorer for evaluation rows" in proc.stderr
