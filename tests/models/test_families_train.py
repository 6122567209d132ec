"""`megatron-rl train` end to end on each new family's tiny model: the local engine generates with the family's own
transformers model and records its routes, the trainer replays them (R3), and weight sync hands each update back.

Two RL steps with an entropy bonus (a random tiny model earns no reward, so the bonus is what moves the weights):
the first update of each step has ppo_kl exactly 0, and on step 2, after the first weight sync, the trainer's
log-probs of the engine's tokens equal the engine's own (fp32, max 1e-4; measured ~1e-6), so the engine received
exactly the trained weights, router bias and fused expert tensors included.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_rl.tiny_model import build_char_tokenizer
from tests.models.tiny_deepseek_v3 import build_tiny_deepseek_v3
from tests.models.tiny_glm4_moe import FULL, make_tiny_glm4_moe
from tests.models.tiny_gpt_oss import build_tiny_gpt_oss
from tests.shared_runs import TRAIN

BUILDERS = {
    "deepseek_v3": lambda path: build_tiny_deepseek_v3(path, q_lora_rank=24, seed=3),
    "glm4_moe": lambda path: make_tiny_glm4_moe(path, FULL, seed=3),
    "gpt_oss": lambda path: build_tiny_gpt_oss(path, seed=3),
}

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_two_rl_steps_with_r3_and_exact_weight_sync(family: str, tmp_path: Path) -> None:
    model = BUILDERS[family](tmp_path / "model")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    build_char_tokenizer(vocab).save_pretrained(model)
    out = tmp_path / "run"
    overrides = [
        f"trainer.output_dir={out}", f"model.hf_path={model}", "trainer.steps=2", "warmup.sft_steps=0",
        "data.eval=null", "data.eval_every=0", "trainer.save_every=0", "logging.wandb=false", "logging.plot=false",
        "algo.routing_replay=R3", "algo.entropy_coef=0.01", "rollout.n_samples=4", "rollout.prompts_per_step=4",
        "parallel.etp=1",
    ]  # fmt: skip
    proc = subprocess.run([*TRAIN, *overrides], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/ppo_kl_first"] == 0.0 for r in rows)
    assert rows[0]["actor/grad_norm"] > 0, "the entropy bonus did not move the weights: weight sync is untested"
    assert rows[1]["mismatch/logp_abs_diff_max"] < 1e-4, rows[1]["mismatch/logp_abs_diff_max"]
