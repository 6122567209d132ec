"""`algo.first_update_check`: the first update's old log-probs from its own forward train exactly like scoring them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.routing.replay import ReplayChecks, ReplayMode
from megatron_rl.routing.step_routes import StepRoutes
from megatron_rl.trainer.step.policy_updates import first_update_scores_itself
from tests.dist_harness import run_torchrun
from tests.shared_runs import WarmedModel
from tests.trainer.test_train_loop import NO_WARMUP, _history, _train


class Dims:
    top_k, num_experts, moe_layers = 2, 8, [0, 1]


def _algo(*overrides: str):
    return load_config(None, ["model.hf_path=/m", *overrides]).algo


def test_which_steps_score_the_first_mini_batch_in_the_old_policy_pass() -> None:
    default = _algo()
    assert default.first_update_check == "first_step"
    quiet = ReplayChecks(check=False, agreement=False)
    assert [first_update_scores_itself(default, s, 4, None, quiet) for s in (4, 5, 9)] == [False, True, True]
    assert not first_update_scores_itself(_algo("algo.first_update_check=every_step"), 5, 4, None, quiet)
    r2, r3 = (StepRoutes(ReplayMode(m), Dims(), [0, 1]) for m in ("R2", "R3"))
    assert not first_update_scores_itself(default, 5, 4, r2, quiet)  # R2 records routes in the scoring pass
    assert first_update_scores_itself(default, 5, 4, r3, ReplayChecks(check=True, agreement=False))
    assert not first_update_scores_itself(default, 5, 4, r3, ReplayChecks(check=False, agreement=True))
    with pytest.raises(ValueError, match="first_update_check"):
        _algo("algo.first_update_check=sometimes")


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.preset=gspo"],  # the demo's: two mini-batches, one epoch, the packed GSPO kernel
        # R3 replay, two epochs (the first mini-batch's old log-probs are read again by a later update), token-level
        # TIS (the correction weights read the old log-probs), the reference loss
        ["algo.preset=grpo", "algo.routing_replay=R3", "algo.replay_agreement_every=0", "algo.ppo_epochs=2",
         "algo.rollout_correction=tis"],
    ],
    ids=["gspo", "grpo-r3-epochs2-tis"],
)
def test_the_first_updates_own_old_log_probs_train_bitwise_as_scoring_them(
    warmed_demo: WarmedModel, tmp_path: Path, overrides: list[str]
) -> None:
    """From step 2 on, `first_step` takes the first mini-batch's old log-probs and entropy from its update's
    forward instead of the old-policy pass; every metric (the old policy's entropy and the trainer-engine mismatch
    included) and the weights after 3 steps equal those of `every_step`, which scores it, bit for bit."""
    common = ["trainer.steps=3", NO_WARMUP, "data.eval=null", "data.eval_every=0", "trainer.save_every=3",
              "logging.plot=false", *overrides]  # fmt: skip
    runs = {check: tmp_path / check for check in ("every_step", "first_step")}
    for check, out in runs.items():
        _train(out, warmed_demo.warmed, *common, f"algo.first_update_check={check}")
    scored, own = (_history(out) for out in runs.values())
    assert [r["actor/ppo_kl_first_checked"] for r in scored] == [1.0, 1.0, 1.0]
    assert [r["actor/ppo_kl_first_checked"] for r in own] == [1.0, 0.0, 0.0]  # steps 2, 3: the update's forward
    for a, b in zip(scored, own, strict=True):
        assert a["actor/ppo_kl_first"] == b["actor/ppo_kl_first"] == 0.0
        assert a["actor/ppo_kl"] != 0.0  # the later updates are off-policy: their ratios read the old log-probs
        for key in sorted(set(a) | set(b)):
            if not key.startswith(("time/", "perf/", "memory/", "actor/ppo_kl_first_checked")):
                assert b.get(key) == a.get(key), (a["step"], key)
    result = tmp_path / "cmp.json"
    checkpoints = [str(out / "checkpoints" / "step_000000003") for out in runs.values()]
    run_torchrun(
        Path(__file__).parent / "scripts" / "compare_checkpoints.py",
        1,
        ["--model", str(warmed_demo.warmed), "--a", checkpoints[0], "--b", checkpoints[1], "--out", str(result)],
    )
    assert json.loads(result.read_text()) == {"equal": True, "moved_from_initial": True}
