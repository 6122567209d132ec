"""The sampling settings of a generate call and the limits of a multi-turn trajectory: config data the rollout
engines and environments read (`rollout.sampling`, `rollout.env_options.limits`, the evaluation sets' sampling)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call (SGLang's names)."""

    max_new_tokens: int = field(default=128, metadata={"help": "response length cap (tokens)"})
    temperature: float = field(default=1.0, metadata={"help": "softmax temperature; 0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass"})
    top_k: int = field(default=-1, metadata={"help": "sample among the k most likely tokens; -1 = all"})
    stop_token_ids: tuple[int, ...] = field(default=(), metadata={"help": "tokens that end a response"})
    seed: int | None = field(default=None, metadata={"help": "sampling seed (reproducible rollouts)"})


@dataclass(frozen=True)
class TurnLimits:
    """Limits of one trajectory (`params.max_new_tokens` caps each turn)."""

    max_turns: int = field(default=4, metadata={"help": "model turns per trajectory", "ge": 1})
    max_tokens: int = field(default=2048, metadata={"help": "tokens per trajectory, prompt included", "ge": 2})
