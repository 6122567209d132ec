"""The multi-turn tool example learns (issue 21 item 5): after its supervised warm-up, GSPO raises the sampled
tool-call success rate, the rollout reward and the held-out greedy accuracy of the calculator task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.shared_runs import DEMO_SEED

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_moe_tool_gspo.yaml"


def test_tool_example_raises_tool_success_and_accuracy(tmp_path: Path) -> None:
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=DEMO_SEED)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
         f"model.hf_path={model}", "trainer.steps=60", "data.eval_every=60", "trainer.save_every=0",
         "logging.wandb=false", "logging.plot=false"],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in history if r["step"] > 0]
    assert len(steps) == 60

    def mean(key: str, rows: list[dict]) -> float:
        return sum(r[key] for r in rows) / len(rows)

    # Measured (seed 1234, deterministic on CPU): steps 1-20 vs 41-60, reward 0.483 -> 0.597, tool-call success
    # 0.884 -> 0.928, tool errors per trajectory 0.114 -> 0.070.
    early, late = steps[:20], steps[-20:]
    assert mean("rollout/reward_mean", late) > mean("rollout/reward_mean", early) + 0.06
    assert mean("multi_turn/tool_success_rate", late) > mean("multi_turn/tool_success_rate", early) + 0.02
    assert mean("multi_turn/tool_errors_per_trajectory", late) < mean("multi_turn/tool_errors_per_trajectory", early)
    for r in steps:
        assert r["actor/ppo_kl_first"] == 0.0
        assert 1.5 < r["multi_turn/turns_mean"] <= 3.0  # a call turn, then the answer turn
        assert 0.05 < r["multi_turn/observation_token_share"] < 0.4
    # Greedy on 64 held-out problems, measured 0.547 -> 0.812 (tool errors per trajectory 0.016 -> 0).
    before, after = history[0]["eval/accuracy"], steps[-1]["eval/accuracy"]
    assert before > 0.2 and after > before + 0.15, f"held-out accuracy {before:.3f} -> {after:.3f}"
