"""`trainer.stop_on` (config/stop_on.py, trainer/guards/fidelity_guard.py): each watched metric stops on the right side
of its threshold, with a message naming the metric, the threshold, its recent values and the usual causes; bad keys
are refused at load.

The rows are steps 1-5 of a real run (`megatron-rl train examples/tiny_moe_grpo_r2.yaml algo.routing_replay=R3`,
fp32 CPU, 2026-12-02; the logged keys this guard reads), so each threshold is checked against values a run logs.
The end-to-end stop of a real run is tests/faults/test_stop_on.py.
"""

from __future__ import annotations

import math

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.stop_on import StopRule, default_stop_on, stop_rules
from megatron_rl.trainer.guards.fidelity_guard import FidelityGuard

EXAMPLE = "examples/tiny_moe_gspo.yaml"
R3_ROWS = [
    {"mismatch/k3_kl": -2.98902e-09, "mismatch/logp_abs_diff_max": 2.38419e-06, "actor/grad_norm": 1.27656,
     "routing/agreement": 0.995492},
    {"mismatch/k3_kl": -1.49012e-09, "mismatch/logp_abs_diff_max": 3.33786e-06, "actor/grad_norm": 0.368202,
     "routing/agreement": 0.996575},
    {"mismatch/k3_kl": -2.115e-09, "mismatch/logp_abs_diff_max": 3.45707e-06, "actor/grad_norm": 337.589,
     "routing/agreement": 0.999521},
    {"mismatch/k3_kl": -1.84534e-09, "mismatch/logp_abs_diff_max": 2.14577e-06, "actor/grad_norm": 2.40745,
     "routing/agreement": 0.999554},
    {"mismatch/k3_kl": -9.14182e-10, "mismatch/logp_abs_diff_max": 1.90735e-06, "actor/grad_norm": 0.558556,
     "routing/agreement": 0.996564},
]  # fmt: skip


def first_stop(rules: list[StopRule], rows: list[dict]) -> tuple[int, str] | None:
    guard = FidelityGuard(rules)
    for step, row in enumerate(rows, start=1):
        if (message := guard.problem(step, row)) is not None:
            return step, message
    return None


@pytest.mark.parametrize(
    ("metric", "threshold", "step", "causes"),
    [
        ("mismatch/k3_kl", -2.0e-9, 2, "stale or partial weight sync"),  # the run's k3 sits at 0 (rounding < 0)
        ("mismatch/logp_abs_diff_max", 3.4e-6, 3, "different kernel"),
        ("actor/grad_norm", 300.0, 3, "learning rate too high"),
        ("routing/agreement", 0.9965, 1, "R3"),  # below = stop
    ],
)
def test_each_threshold_stops_on_its_side_with_the_message(metric: str, threshold: float, step: int, causes: str):
    stopped = first_stop([StopRule(metric, threshold)], R3_ROWS)
    assert stopped is not None and stopped[0] == step, stopped
    message = stopped[1]
    assert message.startswith(f"{metric}=") and f"at step {step} is" in message
    assert f"threshold {threshold:g}" in message and causes in message
    shown = [f"{row[metric]:.4g}" for row in R3_ROWS[max(0, step - 5) : step]]
    assert f"last {len(shown)} steps: {', '.join(shown)}" in message, message
    assert f"trainer.stop_on[{metric!r}]" in message


def test_the_healthy_run_passes_the_defaults_and_history_is_the_last_five() -> None:
    cfg = load_config(EXAMPLE, ["algo.routing_replay=R3", "model.options.routing_replay=true"])
    rules, errors = stop_rules(cfg)
    assert not errors and {r.metric for r in rules} == set(R3_ROWS[0])
    assert first_stop(rules, R3_ROWS * 3) is None
    guard = FidelityGuard([StopRule("actor/grad_norm", 1.0)])
    rows = [{"actor/grad_norm": 0.1 * i} for i in range(1, 9)] + [{"actor/grad_norm": 2.0}]
    messages = [guard.problem(i, row) for i, row in enumerate(rows, start=1)]
    assert messages[:-1] == [None] * 8
    assert "(last 5 steps: 0.5, 0.6, 0.7, 0.8, 2)" in messages[-1]


def test_the_largest_update_norm_is_checked_and_non_finite_values_are_left_to_on_nonfinite() -> None:
    guard = FidelityGuard([StopRule("actor/grad_norm", 10.0)])
    assert guard.problem(1, {"actor/grad_norm": 1.0, "actor/grad_norm_max": 50.0}) is not None
    guard = FidelityGuard([StopRule("actor/grad_norm", 10.0), StopRule("mismatch/k3_kl", 0.1)])
    assert guard.problem(1, {"actor/grad_norm": math.nan, "mismatch/k3_kl": math.inf}) is None
    assert guard.problem(2, {}) is None  # a step without the metric (routing/agreement not measured) passes


def test_skip_is_no_stop_and_is_handed_to_the_update() -> None:
    cfg = load_config(EXAMPLE, ["trainer.stop_on={actor/grad_norm: {threshold: 1.0e-6, action: skip}}"])
    guard = FidelityGuard(stop_rules(cfg)[0])
    assert guard.skip_grad_norm_above == 1e-6
    assert first_stop(guard.rules, R3_ROWS) is None


def test_defaults_per_dtype_engine_and_mode() -> None:
    assert default_stop_on(load_config(EXAMPLE, ["model.options.dtype=bf16"])) == {}
    fp32 = default_stop_on(load_config(EXAMPLE))
    assert set(fp32) == {"mismatch/k3_kl", "mismatch/logp_abs_diff_max", "actor/grad_norm"}  # no replay: no routes
    sglang = default_stop_on(load_config(EXAMPLE, ["rollout.engine=sglang"]))
    assert set(sglang) == {"actor/grad_norm"}  # the engine's numerics were measured for the local engine only
    in_async = default_stop_on(load_config(EXAMPLE, ["trainer.mode=async"]))
    assert set(in_async) == {"actor/grad_norm"}  # async samples are a version old: the mismatch includes that
    assert stop_rules(load_config(EXAMPLE, ["trainer.stop_on={}"])) == ([], [])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("{actor/grad_nrm: 1.0}", "trainer.stop_on['actor/grad_nrm']: unknown metric (did you mean "
         "'actor/grad_norm'?); the metrics it can watch: actor/grad_norm, mismatch/k3_kl, "
         "mismatch/logp_abs_diff_max, routing/agreement"),
        ("{mismatch/k3_kl: {threshold: 0.1, action: skip}}", "action 'skip' applies only to actor/grad_norm"),
        ("{actor/grad_norm: {limit: 3}}", "expected a number or {threshold: N, action: stop|skip} (unknown key "
         "'limit')"),
        ("{actor/grad_norm: high}", "threshold 'high': expected a number"),
        ("{routing/agreement: 0.9}", "trainer.stop_on['routing/agreement'] reads a metric logged only with routing "
         "replay: set algo.routing_replay=R2 or R3"),
    ],
)  # fmt: skip
def test_bad_stop_on_is_refused_at_load(value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, [f"trainer.stop_on={value}"])
    assert expected in str(err.value), str(err.value)
