"""Options that defeat routing replay are refused when the model is built; the replay-mode and
exactly-once rules."""

from types import SimpleNamespace

import pytest

from megatron_rl.routing.compat import refuse_unsafe_replay_options
from megatron_rl.routing.replay import ReplayMode, RouteReplayError, RouterUse, check_consumed

SAFE = dict(
    moe_enable_routing_replay=True,
    moe_router_fusion=False,
    moe_router_load_balancing_type="aux_loss",
    moe_expert_capacity_factor=None,
)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"moe_router_fusion": True}, "moe_router_fusion=True"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
        ({"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor=1.0"),
    ],
)
def test_unsafe_options_refused(change: dict, match: str) -> None:
    refuse_unsafe_replay_options(SimpleNamespace(**SAFE))
    with pytest.raises(ValueError, match=match) as err:
        refuse_unsafe_replay_options(SimpleNamespace(**{**SAFE, **change}))
    assert "routing_replay=false" in str(err.value)
    refuse_unsafe_replay_options(SimpleNamespace(**{**SAFE, **change, "moe_enable_routing_replay": False}))


def test_model_config_refuses_capacity_factor_with_replay(tiny_moe_dir, monkeypatch) -> None:
    import dataclasses

    from megatron_rl.megatron_backend.actor import model_builder
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.models import family
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.parallel_layout import ParallelLayout

    hf = read_hf_config(tiny_moe_dir)
    fam = family.get_family(hf)
    dropping = dataclasses.replace(
        fam, transformer_config_kwargs=lambda h: {**fam.transformer_config_kwargs(h), "moe_expert_capacity_factor": 1.0}
    )
    monkeypatch.setattr(model_builder, "get_family", lambda h: dropping)
    with pytest.raises(ValueError, match="moe_expert_capacity_factor"):
        model_builder.transformer_config(hf, ParallelLayout(), ModelOptions(routing_replay=True))
    model_builder.transformer_config(hf, ParallelLayout(), ModelOptions(routing_replay=False))


def test_replay_modes() -> None:
    assert not ReplayMode("off").on
    r2, r3 = ReplayMode("R2"), ReplayMode("R3")
    assert r2.record_old_logprobs and not r2.replay_old_logprobs and r2.replay_training
    assert r3.replay_old_logprobs and r3.routes_from_rollout and not r3.record_old_logprobs
    with pytest.raises(ValueError):
        ReplayMode("R4")


def test_consumed_exactly_once() -> None:
    check_consumed([RouterUse(0, 3, 0, 3, 0)], 3, recompute=False)
    check_consumed([RouterUse(0, 3, 3, 0, 0)], 3, recompute=True)
    with pytest.raises(RouteReplayError, match="layer 2: 3 replayed forwards, 2 recomputes, 1 routes left"):
        check_consumed([RouterUse(2, 3, 2, 1, 0)], 3, recompute=True)
    with pytest.raises(RouteReplayError, match="did not route as replayed"):
        check_consumed([RouterUse(0, 3, 0, 3, 1)], 3, recompute=False)
