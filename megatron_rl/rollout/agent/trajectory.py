"""A multi-turn trajectory as one token sequence with a loss mask.

The sequence is the prompt, then turn after turn the model's generated tokens (trained: loss mask 1, with the
engine's log-prob and the weight version of the turn) and the observation that follows them (tool output, user
reply, chat-template glue: loss mask 0, log-prob 0.0). Training scores the whole sequence in one forward pass and
the mask keeps observation tokens out of every loss and aggregation, as slime's `loss_mask` and verl's
`response_mask` do.

Limits: at most `max_turns` generated turns and `max_tokens` tokens in all (prompt included). A turn or an
observation that does not fit is cut at the limit and the trajectory ends with finish reason "length", like an
overlong single-turn response (so overlong masking or penalties apply to it unchanged). Tokens after the last
generated turn would train nothing and are dropped, so the sequence always ends with a generated token.

Routes (R3): the engine records, with each turn, the experts of every position it fed, prefilled or generated
(SGLang's layout, `[len(sequence) - 1, moe_layers, top_k]`). The last turn fed the whole final sequence, so its
routes, cut to the final length, are the trajectory's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from megatron_rl.rollout.sample import FinishReason


@dataclass(frozen=True)
class Turn:
    """One generated turn: response positions [start, end) (offsets after the prompt)."""

    start: int
    end: int
    weight_version: str  # the weights that generated it (they can change between turns in async mode)


@dataclass(frozen=True)
class Trajectory:
    """What training needs of a multi-turn rollout (verl's `AgentLoopOutput`). Per-token lists cover the response
    part, `response_ids`, which starts at `response_start` in `tokens`."""

    prompt_ids: list[int]
    response_ids: list[int]  # generated and observation tokens, in order
    loss_mask: list[int]  # 1 on generated tokens, 0 on observation tokens
    response_log_probs: list[float]  # the engine's log-prob of each generated token; 0.0 where loss_mask is 0
    turns: tuple[Turn, ...]
    finish_reason: FinishReason  # "length" when a limit cut it, "abort" when a turn was aborted
    reward: float = 0.0  # the environment's contributions, summed
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's counters, summed
    routed_experts: np.ndarray | None = None  # [len(tokens) - 1, moe_layers, top_k], as `Sample.routed_experts`

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_start(self) -> int:
        return len(self.prompt_ids)

    @property
    def weight_versions(self) -> list[str]:
        return [turn.weight_version for turn in self.turns]


class TrajectoryBuilder:
    """Appends turns and observations under the limits; `build()` gives the `Trajectory`."""

    def __init__(self, prompt_ids: list[int], *, max_turns: int, max_tokens: int):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if len(prompt_ids) >= max_tokens:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, max_tokens is {max_tokens}")
        self.prompt_ids = list(prompt_ids)
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []
        self.turns: list[Turn] = []
        self.reward = 0.0
        self.metrics: dict[str, float] = {}
        self.routed_experts: np.ndarray | None = None
        self.ended: FinishReason | None = None  # set when a limit or an aborted turn ended the trajectory

    @property
    def tokens(self) -> list[int]:
        """The sequence so far: the next turn's prompt."""
        return self.prompt_ids + self.response_ids

    @property
    def remaining_tokens(self) -> int:
        """Tokens the sequence may still grow by: cap the next turn's `max_new_tokens` with it."""
        return self.max_tokens - len(self.prompt_ids) - len(self.response_ids)

    @property
    def can_generate(self) -> bool:
        """Whether another model turn may follow."""
        return self.ended is None and len(self.turns) < self.max_turns and self.remaining_tokens > 0

    def add_turn(
        self,
        token_ids: list[int],
        log_probs: list[float],
        weight_version: str,
        finish_reason: FinishReason,
        routed_experts: np.ndarray | None = None,
    ) -> None:
        """Append a generated turn (the engine's sample of `tokens`), with the routes of the positions it fed when
        recorded. A turn the engine cut ("length") or aborted ends the trajectory with that reason; one longer than
        `remaining_tokens` is cut and ends it with "length"."""
        if not self.can_generate:
            raise ValueError("no further turn allowed: the trajectory ended or reached max_turns")
        if len(log_probs) != len(token_ids):
            raise ValueError(f"{len(log_probs)} log-probs for {len(token_ids)} generated tokens")
        fed = len(self.tokens) + len(token_ids) - 1
        if routed_experts is not None and routed_experts.shape[0] != fed:
            raise ValueError(f"routes of {routed_experts.shape[0]} positions for a turn that fed {fed}")
        kept = self._fit(len(token_ids))
        start = len(self.response_ids)
        self.response_ids += token_ids[:kept]
        self.loss_mask += [1] * kept
        self.log_probs += [float(x) for x in log_probs[:kept]]
        self.turns.append(Turn(start, start + kept, weight_version))
        self.routed_experts = None if routed_experts is None else routed_experts[: len(self.tokens) - 1]
        if finish_reason != "stop":
            self.ended = self.ended or finish_reason

    def add_observation(self, token_ids: list[int]) -> None:
        """Append the environment's answer to the last turn (untrained); cut at the token limit (the trajectory then
        ends with "length")."""
        if self.ended is not None:
            raise ValueError(f"the trajectory already ended ({self.ended})")
        kept = self._fit(len(token_ids))
        self.response_ids += token_ids[:kept]
        self.loss_mask += [0] * kept
        self.log_probs += [0.0] * kept

    def credit(self, reward: float, metrics: Mapping[str, float]) -> None:
        """Add an environment step's reward contribution and counters to the trajectory's sums."""
        self.reward += reward
        for name, value in metrics.items():
            self.metrics[name] = self.metrics.get(name, 0.0) + value

    def _fit(self, n: int) -> int:
        """How many of `n` new tokens fit; ends the trajectory with "length" when not all do."""
        kept = min(n, self.remaining_tokens)
        if kept < n:
            self.ended = "length"
        return kept

    def build(self, *, done: bool) -> Trajectory:
        """The trajectory; `done`: the environment ended the episode. Not done and not otherwise ended means the
        turn limit stopped it: finish reason "length"."""
        if not self.turns:
            raise ValueError("a trajectory needs at least one generated turn")
        reason: FinishReason = self.ended or ("stop" if done else "length")
        end = self.turns[-1].end  # drop an observation after the last turn
        return Trajectory(
            self.prompt_ids,
            self.response_ids[:end],
            self.loss_mask[:end],
            self.log_probs[:end],
            tuple(self.turns),
            reason,
            self.reward,
            dict(self.metrics),
            self.routed_experts,
        )
