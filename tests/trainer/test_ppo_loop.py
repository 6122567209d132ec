"""PPO with a learned critic in the RL loop (`algo.advantage: gae`, `algo.critic`).

The learning test runs the demo's task from the warmed-up demo model with the actor's λ = 0: each token's advantage
is the critic's one-step TD error `r_t + V(s_{t+1}) − V(s_t)`, so the policy learns only as well as the critic
predicts. Measured on this machine (seed 1234, 150 critic warm-up steps at lr 3e-4, 20 PPO steps, 256 held-out
prompts): learned critic 0.633 -> 0.711; the frozen-critic control (`algo.critic.lr=0`, the fresh head's values)
0.633 -> 0.195; with the value loss's sign flipped (a broken value gradient), 0.633 -> 0.0. With λ = 1 (the `ppo`
preset) the critic is only a baseline under whitened advantages and the frozen control learns as well (0.633 ->
0.836 both, 20 steps), so that setting cannot tell a working critic from a broken one. Asserted: a rise above 0.03
and 0.2 above the control.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import run_torchrun
from tests.shared_runs import EXAMPLE, WarmedModel

IGNORED = ("time/", "perf/", "sync/")  # a resumed start's first weight sync sends every tensor
TRAIN = [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE)]


def _train(out: Path, model: Path, *overrides: str) -> tuple[list[dict], str]:
    command = [*TRAIN, f"trainer.output_dir={out}", f"model.hf_path={model}", "warmup.sft_steps=0",
               "logging.plot=false", "algo.preset=ppo", *overrides]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], proc.stdout


def test_ppo_with_a_critic_trains_on_policy_and_resumes_bitwise(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    """Two critic warm-up steps, the KL in the reward; four steps straight equal two, a resume and two more, in
    every metric (the critic's included: its weights, Adam state and schedule are in the checkpoint)."""
    run = ("data.eval=null", "data.eval_every=0", "trainer.save_every=2", "algo.critic.warmup_steps=2",
           "algo.critic.lr=3e-4", "algo.kl_coef=0.05", "algo.kl_in_reward=true",
           "algo.critic.lam_actor=0.9")  # fmt: skip
    model = warmed_demo.warmed
    straight, printed = _train(tmp_path / "straight", model, "trainer.steps=4", *run)
    _train(tmp_path / "resumed", model, "trainer.steps=2", *run)
    resumed, printed_on_resume = _train(tmp_path / "resumed", model, "trainer.steps=4", "trainer.resume=auto", *run)
    assert printed.count("critic warm-up ") == 2 and "critic warm-up" not in printed_on_resume
    assert [r["step"] for r in straight] == [1, 2, 3, 4] == [r["step"] for r in resumed]
    for a, b in zip(straight, resumed, strict=True):
        assert a["actor/ppo_kl_first"] == 0.0
        assert "actor/kl_ref" not in a  # the KL is in the reward, not in the loss
        same = [k for k in a if not k.startswith(IGNORED) and k != "actor/ppo_kl_first_checked"]
        assert {k: a[k] for k in same} == {k: b[k] for k in same}, a["step"]
    for row in straight:
        assert row["critic/vf_loss"] > 0 and row["critic/grad_norm"] > 0 and 0 <= row["critic/vf_clip_frac"] <= 1
        assert math.isfinite(row["critic/explained_variance"]) and row["critic/lr"] == 3e-4
    assert straight[0]["critic/values_mean"] != straight[-1]["critic/values_mean"]


def test_a_learned_critic_raises_accuracy_and_a_frozen_one_does_not(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    td0 = ("algo.critic.lam_actor=0.0", "algo.critic.warmup_steps=150", "trainer.steps=20", "data.eval_every=20",
           "data.eval_prompts=256", "trainer.save_every=0")  # fmt: skip
    accuracy = {}
    for arm, lr in (("learned", "3e-4"), ("frozen", "0")):
        rows, _ = _train(tmp_path / arm, warmed_demo.warmed, f"algo.critic.lr={lr}", *td0)
        accuracy[arm] = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    (start, learned), (_, frozen) = accuracy["learned"], accuracy["frozen"]
    assert learned > start + 0.03 and learned > frozen + 0.2, accuracy


@pytest.mark.torchrun
def test_ppo_at_dp2_with_offload_matches_one_process(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    """PPO under torchrun at DP=2, actor and critic offloaded during rollouts: each rank scores and trains only its
    rows, the advantages are whitened over both ranks' tokens, and every loss equals the one-process run's."""
    run = ("trainer.steps=2", "data.eval=null", "data.eval_every=0", "trainer.save_every=0",
           "algo.critic.warmup_steps=1", "algo.critic.lr=3e-4", "algo.critic.lam_actor=0.9")  # fmt: skip
    one, _ = _train(tmp_path / "one", warmed_demo.warmed, *run)
    run_torchrun(
        Path(__file__).parents[2] / "megatron_rl" / "cli.py",
        2,
        ["train", str(EXAMPLE), f"trainer.output_dir={tmp_path / 'dp2'}", f"model.hf_path={warmed_demo.warmed}",
         "warmup.sft_steps=0", "logging.plot=false", "algo.preset=ppo", "trainer.offload_actor=true",
         *run],
        timeout=600,
    )  # fmt: skip
    dp2 = [json.loads(line) for line in (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()]
    assert len(one) == len(dp2) == 2
    for a, b in zip(one, dp2, strict=True):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"] and b["actor/ppo_kl_first"] == 0.0
        assert b["memory/critic_offloaded_gib"] > 0 and "time/critic_reload" in b
        for key in ("critic/values_mean", "critic/returns_mean", "critic/advantages_std", "critic/vf_loss",
                    "critic/explained_variance", "actor/pg_loss"):  # fmt: skip
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["critic/grad_norm"] == pytest.approx(a["critic/grad_norm"], rel=1e-3)
