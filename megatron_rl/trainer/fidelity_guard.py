"""`trainer.stop_on`: stop the run when a logged fidelity metric leaves its healthy range (or, for the grad norm,
skip and count the update).

Pure: the rules are read from the config (`stop_rules`, called by the config validation and by the
trainer), and `FidelityGuard.problem` reads one step's logged metrics. Non-finite values are
`trainer.on_nonfinite`'s: a NaN/inf metric never trips a threshold here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
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
# trainer and fp32 local engine. The mismatch and the route agreement depend on the engine's numerics as much as
# the trainer's, so their defaults hold for the local engine only; bf16 has no measured range here: off.
MEASURED_FP32: dict[str, float] = {
    "mismatch/k3_kl": 1e-5,
    "mismatch/logp_abs_diff_max": 1e-3,
    "routing/agreement": 0.95,
    "actor/grad_norm": 5000.0,
}
ENGINE_INDEPENDENT = ("actor/grad_norm",)


def default_stop_on(cfg: RLConfig) -> dict[str, float]:
    """The thresholds `trainer.stop_on: null` means for this run: the measured fp32 ones (the mismatch and route
    agreement ones with the local engine only; route agreement where the run logs it), nothing for bf16."""
    if cfg.model.options.dtype != "fp32":
        return {}
    agreement = cfg.algo.routing_replay != "off" and cfg.algo.replay_agreement_every > 0
    return {
        metric: threshold
        for metric, threshold in MEASURED_FP32.items()
        if (cfg.rollout.engine == "local" or metric in ENGINE_INDEPENDENT)
        and (metric != "routing/agreement" or agreement)
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


class FidelityStop(ValueError):
    """A `trainer.stop_on` threshold was crossed; a ValueError, so the CLI prints its one line: the cause is a
    property of the run (its weights sync, kernels, data or learning rate), not the code."""


@dataclass
class FidelityGuard:
    """The run's stop rules, and the recent values of each watched metric (for the message)."""

    rules: list[StopRule]
    recent: int = 5
    _history: dict[str, deque[float]] = field(default_factory=dict)

    @property
    def skip_grad_norm_above(self) -> float | None:
        """The grad norm above which an update is dropped before the optimizer step (action: skip), else None."""
        return next((r.threshold for r in self.rules if r.metric == "actor/grad_norm" and r.action == "skip"), None)

    def problem(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """The message naming the first stop rule step `step`'s `metrics` cross, else None. Metrics the step did
        not log (routing/agreement off this step) and non-finite values are not checked."""
        found = None
        for rule in self.rules:
            watched = WATCHED[rule.metric]
            value = metrics.get(watched.reads or rule.metric, metrics.get(rule.metric))
            if value is None or not math.isfinite(value):
                continue
            history = self._history.setdefault(rule.metric, deque(maxlen=self.recent))
            history.append(float(value))
            crossed = value > rule.threshold if watched.above else value < rule.threshold
            if found is None and crossed and rule.action == "stop":
                found = stop_message(rule, step, list(history))
        return found


def stop_message(rule: StopRule, step: int, recent: list[float]) -> str:
    """One line: the metric, its value and side of the threshold, its recent values, the usual causes, the key."""
    watched = WATCHED[rule.metric]
    side = "above" if watched.above else "below"
    values = ", ".join(f"{v:.4g}" for v in recent)
    return (
        f"{rule.metric}={recent[-1]:.4g} at step {step} is {side} the trainer.stop_on threshold {rule.threshold:g} "
        f"(last {len(recent)} steps: {values}); usually: {watched.causes}. The run stopped before checkpointing "
        f"this step; change or remove trainer.stop_on[{rule.metric!r}] to go on"
    )
