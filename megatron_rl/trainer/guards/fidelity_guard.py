"""`trainer.stop_on` at run time: stop the run when a logged fidelity metric crosses its threshold
(`config/stop_on.py` holds the metrics and the rules; the grad norm's skip action is the actor's).

Pure: `FidelityGuard.problem` reads one step's logged metrics and keeps each watched metric's recent values for
the message. Non-finite values are `trainer.on_nonfinite`'s: a NaN/inf metric never trips a threshold here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_rl.config.stop_on import WATCHED, StopRule


class FidelityStop(RuntimeError):
    """A `trainer.stop_on` threshold was crossed: the run stops on purpose, as on a failed weight-sync probe (the
    CLI prints the one line after "stopped:" and exits 3); the cause is a property of the run (its weight sync,
    kernels, data or learning rate), not of the code."""

    stops_run = True


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
