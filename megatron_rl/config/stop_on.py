"""`trainer.stop_on`: the fidelity metrics a run can stop on, what each means, and the run's rules read from the
config (`stop_rules`: called by the config validation and by the trainer's `FidelityGuard`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from megatron_rl.config.coercion import suggest
from megatron_rl.config.schema import RLConfig


@dataclass(frozen=True)
class Watched:
    """What a watched metric means: which side of the threshold is unhealthy, whether an update can be skipped
    instead of stopping, and what usually drives it there."""

    above: bool  # True: unhealthy above the threshold; False: below it
    causes: str
    skippable: bool = False
    reads: str = ""  # the logged key compared with the threshold, when it is not the metric's own name


WATCHED: dict[str, Watched] = {
    "mismatch/k3_kl": Watched(
        above=True,
        causes="the engine and the trainer compute different log-probs of the same tokens: a stale or partial "
        "weight sync, a kernel or dtype that differs between them (attention backend, MoE kernel, bf16 vs fp32), "
        "or routing that differs (routing replay off on a MoE)",
    ),
    "mismatch/logp_abs_diff_max": Watched(
        above=True,
        causes="one token's log-prob differs far more between engine and trainer than the rest: a stale or partial "
        "weight sync, a different kernel, a token routed to other experts, or a long-context numerics gap",
    ),
    "routing/agreement": Watched(
        above=False,
        causes="the replayed routes are not the ones the trainer's routers would choose: routing replay (R3: the "
        "engine's routes) misaligned with the tokens, a stale weight sync, or router drift within the step",
    ),
    "actor/grad_norm": Watched(
        above=True,
        skippable=True,
        reads="actor/grad_norm_max",  # the largest of the step's updates, not only the last one
        causes="an exploding update: the learning rate too high, a batch of bad data or extreme advantages, or "
        "(fp16) the loss scale",
    ),
}


@dataclass(frozen=True)
class StopRule:
    metric: str
    threshold: float
    action: Literal["stop", "skip"] = "stop"


# Measured healthy ranges of the CPU demos with a margin (docs/reliability.md, "Fidelity thresholds"): fp32
# trainer and fp32 local engine, sync mode. The mismatch and the route agreement depend on the engine's numerics
# (and, in async mode, on the samples' staleness) as much as on the trainer's, so their defaults hold for the local
# engine in sync mode only; bf16 has no measured range here: off.
MEASURED_FP32: dict[str, float] = {
    "mismatch/k3_kl": 1e-5,
    "mismatch/logp_abs_diff_max": 1e-3,
    "routing/agreement": 0.95,
    "actor/grad_norm": 2e4,
}
ENGINE_INDEPENDENT = ("actor/grad_norm",)


def default_stop_on(cfg: RLConfig) -> dict[str, float]:
    """The thresholds `trainer.stop_on: null` means for this run: the measured fp32 ones (the mismatch and route
    agreement ones with the local engine in sync mode only; route agreement where the run logs it), none for
    bf16."""
    if cfg.model.options.dtype != "fp32":
        return {}
    as_measured = cfg.rollout.engine == "local" and cfg.trainer.mode == "sync"
    agreement = cfg.algo.routing_replay != "off" and cfg.algo.replay_agreement_every > 0
    return {
        metric: threshold
        for metric, threshold in MEASURED_FP32.items()
        if (as_measured or metric in ENGINE_INDEPENDENT) and (metric != "routing/agreement" or agreement)
    }


def stop_rules(cfg: RLConfig) -> tuple[list[StopRule], list[str]]:
    """`(rules, errors)` of the run's `trainer.stop_on`: null = `default_stop_on`, a mapping of
    `metric: threshold` or `metric: {threshold: N, action: stop|skip}` = exactly these."""
    raw = cfg.trainer.stop_on
    if raw is None:
        return [StopRule(m, t) for m, t in default_stop_on(cfg).items()], []
    rules, errors = [], []
    for metric, value in raw.items():
        rule, error = _parse_rule(str(metric), value)
        if error:
            errors.append(f"trainer.stop_on[{metric!r}]: {error}")
        elif rule is not None:
            rules.append(rule)
    return rules, errors


def _parse_rule(metric: str, value: Any) -> tuple[StopRule | None, str]:
    watched = WATCHED.get(metric)
    if watched is None:
        known = ", ".join(sorted(WATCHED))
        return None, f"unknown metric{suggest(metric, WATCHED)}; the metrics it can watch: {known}"
    form = "expected a number or {threshold: N, action: stop|skip}"
    if isinstance(value, Mapping):
        extra = sorted(set(value) - {"threshold", "action"})
        if extra or "threshold" not in value:
            return None, f"{value!r}: {form}" + (f" (unknown key {extra[0]!r})" if extra else "")
        threshold, action = value["threshold"], value.get("action", "stop")
    else:
        threshold, action = value, "stop"
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        return None, f"threshold {threshold!r}: {form}"
    if action not in ("stop", "skip"):
        return None, f"action {action!r}: must be 'stop' or 'skip'"
    if action == "skip" and not watched.skippable:
        skippable = ", ".join(m for m, w in WATCHED.items() if w.skippable)
        return None, (
            f"action 'skip' applies only to {skippable} (an update can be dropped before the optimizer step); "
            f"a {metric} beyond its threshold does not go away by skipping an update: use action 'stop'"
        )
    return StopRule(metric, float(threshold), action), ""
