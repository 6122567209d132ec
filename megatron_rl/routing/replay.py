"""Routing replay modes and the exactly-once consumption rule.

* `off`: natural routing everywhere.
* `R2` (GSPO's routing replay): record the routes in the old-policy log-prob pass, replay them in training.
* `R3` (rollout routing replay, arXiv 2510.11370): replay the rollout engine's routes in the old-policy
  pass and in training.

Consumption: each replayed route must be used by exactly one forward (Megatron's `REPLAY_FORWARD`
reads the target we set per micro-batch) and, when activation recompute re-runs the router in
backward, by exactly one recompute (`REPLAY_BACKWARD` pops the per-router FIFO). Without recompute the
FIFO is never popped: then "consumed" means every router ran exactly one replayed forward per
micro-batch and the FIFO still holds exactly one entry per micro-batch, which we then drop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["off", "R2", "R3"]


class RouteReplayError(RuntimeError):
    """Replayed routes were not consumed exactly once (misaligned micro-batches or recompute)."""


@dataclass(frozen=True)
class ReplayMode:
    mode: Mode = "off"

    def __post_init__(self):
        if self.mode not in ("off", "R2", "R3"):
            raise ValueError(f"routing replay mode {self.mode!r}: expected off, R2 or R3")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @property
    def record_old_logprobs(self) -> bool:
        """R2: the old-policy pass records the routes training replays."""
        return self.mode == "R2"

    @property
    def replay_old_logprobs(self) -> bool:
        """R3: the old-policy pass already uses the rollout engine's routes."""
        return self.mode == "R3"

    @property
    def replay_training(self) -> bool:
        return self.on

    @property
    def routes_from_rollout(self) -> bool:
        return self.mode == "R3"


@dataclass(frozen=True)
class ReplayChecks:
    """What a replaying pass verifies. `check`: every router call used the replayed experts and each
    micro-batch's routes were consumed exactly once (`RouteReplayError` otherwise). `agreement`: measure the
    replayed routes against the routes the current weights would choose (one router matmul per MoE layer)."""

    check: bool = True
    agreement: bool = True


FULL_CHECKS = ReplayChecks()


@dataclass
class RouterUse:
    """What one router did during one replayed schedule."""

    layer: int
    forwards: int  # REPLAY_FORWARD calls
    recomputes: int  # REPLAY_BACKWARD calls
    fifo_left: int  # entries left in replay_backward_list
    mismatched: int  # calls whose routing differed from the replayed target


def check_consumed(uses: list[RouterUse], micro_batches: int, *, recompute: bool) -> None:
    """Raise `RouteReplayError` unless every router used each micro-batch's routes exactly once in forward
    (and exactly once in recompute when `recompute`), and always routed as told."""
    problems = []
    for u in uses:
        expected_fifo = 0 if recompute else micro_batches
        expected_recomputes = micro_batches if recompute else 0
        if u.forwards != micro_batches or u.recomputes != expected_recomputes or u.fifo_left != expected_fifo:
            problems.append(
                f"layer {u.layer}: {u.forwards} replayed forwards, {u.recomputes} recomputes, {u.fifo_left} routes "
                f"left over (expected {micro_batches}, {expected_recomputes}, {expected_fifo})"
            )
        if u.mismatched:
            problems.append(f"layer {u.layer}: {u.mismatched} router calls did not route as replayed")
    if problems:
        raise RouteReplayError(
            f"replayed routes were not consumed exactly once over {micro_batches} micro-batches "
            f"(activation recompute {'on' if recompute else 'off'}): " + "; ".join(problems)
        )
