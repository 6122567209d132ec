"""What a run shows: the start-up header, the plots (one panel per policy metric, log scale across decades)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from megatron_rl.config import load_config
from megatron_rl.config.schema import LoggingConfig
from megatron_rl.models.family import ModelDims
from megatron_rl.trainer.logs.plots import spans_decades
from megatron_rl.trainer.logs.run_log import RunLog, run_header

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_moe_gspo.yaml"
DIMS = ModelDims(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
    head_dim=16, max_position_embeddings=512, tie_word_embeddings=False, num_experts=8, top_k=2,
    moe_layer_pattern=(1, 0, 1, 1),
)  # fmt: skip


def test_header_names_the_run_in_a_few_lines() -> None:
    cfg = load_config(EXAMPLE, ["algo.preset=grpo", "algo.routing_replay=R2", "parallel.tp=2", "trainer.steps=7"])
    header = run_header(cfg, DIMS, None, 0)
    lines = header.splitlines()
    assert len(lines) == 5
    assert lines[0] == "megatron-rl train: grpo | 7 steps | new run"
    assert "4 layers, hidden 64, 3 MoE layers x 8 experts, top-2" in lines[1]
    assert "loss ppo" in lines[2] and "KL k3 x 0.04" in lines[2] and "routing replay R2" in lines[2]
    assert "8 prompts x 8 samples" in lines[3] and "layout tp=2" in lines[3]
    assert lines[3].startswith("  rollout sync, local engine")
    async_cfg = load_config(EXAMPLE, ["trainer.mode=async", "trainer.max_staleness=2"])
    assert run_header(async_cfg, DIMS, None, 0).splitlines()[3].startswith("  rollout async (max staleness 2), local")
    assert (
        run_header(cfg, DIMS, Path("/r/checkpoints/step_000000004"), 4)
        .splitlines()[0]
        .endswith("resumed from /r/checkpoints/step_000000004 at step 4")
    )


def test_policy_plot_has_a_panel_per_metric(tmp_path: Path) -> None:
    log = RunLog(LoggingConfig(wandb=False, tensorboard=False), tmp_path, 20, {})
    for step in range(1, 21):
        log.log(
            step,
            {
                "rollout/reward_mean": step / 20,
                "actor/pg_loss": 0.01 * (-1) ** step,
                "actor/ppo_kl": 1e-6 * 10 ** (step / 4),  # spans five decades: log scale
                "actor/entropy": 1.0 - step / 40,
                "actor/grad_norm": 1.0,
                "mismatch/logp_abs_diff": 1e-7,
            },
        )
    plots = {p.name: p for p in log.close()}
    assert set(plots) == {"reward.png", "train.png", "mismatch.png"}
    # 100 dpi, 2.2 in + 1.8 in per panel: 4 panels for the policy, reward and accuracy share one panel.
    assert Image.open(plots["train.png"]).size == (700, 940)
    assert Image.open(plots["reward.png"]).size == (700, 400)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 21)
    )


def test_log_scale_only_for_positive_series_across_decades() -> None:
    assert spans_decades([1e-6, 1e-3])
    assert not spans_decades([0.1, 5.0])
    assert not spans_decades([-1e-6, 1e-3])  # a sign change has no log axis
    assert not spans_decades([])


def test_step_line_shows_the_kl_to_the_reference_when_there_is_one(tmp_path: Path) -> None:
    log = RunLog(LoggingConfig(wandb=False, tensorboard=False), tmp_path, 5, {})
    line = log.format_line(1, {"rollout/reward_mean": 0.5, "actor/kl_ref": 1.27e-4, "time/step": 1.0})
    assert "reward 0.500 | kl_ref 1.27e-04 | s/step 1.0" in line
    assert "kl_ref" not in log.format_line(1, {"rollout/reward_mean": 0.5})  # algo.kl_coef = 0: no such metric
    log.close()
