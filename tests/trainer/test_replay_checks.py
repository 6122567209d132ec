"""`algo.replay_check` / `algo.replay_agreement_every`: what each RL step's replaying passes verify."""

from __future__ import annotations

import pytest

from megatron_rl.config import load_config
from megatron_rl.routing.replay import ReplayChecks
from megatron_rl.trainer.step.rl_step import replay_checks


def _cfg(check: str, every: int):
    return load_config(
        None, ["model.hf_path=/m", "algo.routing_replay=R2", f"algo.replay_check={check}",
               f"algo.replay_agreement_every={every}"],
    )  # fmt: skip


def test_defaults_check_and_measure_every_step() -> None:
    cfg = load_config(None, ["model.hf_path=/m"])
    assert (cfg.algo.replay_check, cfg.algo.replay_agreement_every) == ("every_step", 1)
    assert [replay_checks(cfg, step, first_step=1) for step in (1, 2, 7)] == [ReplayChecks(True, True)] * 3


def test_first_step_checks_only_the_first_step_of_each_start() -> None:
    cfg = _cfg("first_step", 0)
    assert [replay_checks(cfg, step, first_step=5).check for step in (5, 6, 9)] == [True, False, False]
    assert replay_checks(cfg, 1, first_step=1).check  # a fresh run's first step
    assert not any(replay_checks(cfg, step, first_step=5).agreement for step in range(5, 12))


def test_agreement_every_n_steps_and_off() -> None:
    cfg = _cfg("off", 3)
    assert [replay_checks(cfg, step, first_step=1) for step in (1, 2, 3, 6)] == [
        ReplayChecks(False, False), ReplayChecks(False, False), ReplayChecks(False, True), ReplayChecks(False, True)
    ]  # fmt: skip


def test_bad_values_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="replay_check"):
        _cfg("sometimes", 1)
    with pytest.raises(ValueError, match="replay_agreement_every"):
        _cfg("off", -1)
