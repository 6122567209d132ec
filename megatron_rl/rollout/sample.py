"""`Sample`: the one record that travels from rollout to training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Sample:
    """One generated response to one prompt, with everything training needs.

    `routed_experts` uses SGLang's layout: `[len(prompt_ids) + len(response_ids) - 1, moe_layers, top_k]`,
    row t = the experts each MoE layer chose for the token at position t (the last token is never fed).
    Stored compactly (uint8 up to 256 experts, else int16).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_log_probs: list[float]  # the rollout engine's log-prob of each response token
    finish_reason: FinishReason
    weight_version: str  # version of the weights that generated the response
    group_index: int = 0  # index of the prompt; samples of one prompt form a GRPO group
    routed_experts: np.ndarray | None = None
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # prompt text, reference answer, ...
    exclude_from_loss: bool = False  # train on nothing of this sample (DAPO overlong filtering of truncated ones)
    loss_mask: list[int] | None = None  # per response token, 1 = trained (None: all); 0 on multi-turn observations
    reward_parts: dict[str, float] = field(default_factory=dict)  # each named reward's unweighted value
    teacher_log_probs: list[float] | None = None  # distillation: log p_teacher(tokens[t] | tokens[:t]), t >= 1
    teacher_topk_ids: list[list[int]] | None = None  # top-k distillation: the teacher's k likeliest ids at t >= 1
    teacher_topk_log_probs: list[list[float]] | None = None  # ... and their log-probs

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (a checkpoint keeps an async run's generated, untrained samples); floats round-trip
        exactly, routes as nested lists with their dtype."""
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        if self.routed_experts is not None:
            data["routed_experts"] = {"dtype": str(self.routed_experts.dtype), "ids": self.routed_experts.tolist()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        routes = data.get("routed_experts")
        if routes is not None:
            routes = np.asarray(routes["ids"], dtype=routes["dtype"])
        return cls(**{**data, "routed_experts": routes})

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def __post_init__(self) -> None:
        if len(self.response_log_probs) != len(self.response_ids):
            raise ValueError(f"{len(self.response_log_probs)} log-probs for {len(self.response_ids)} response tokens")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.response_ids):
            raise ValueError(f"{len(self.loss_mask)} loss-mask entries for {len(self.response_ids)} response tokens")
        if self.routed_experts is not None:
            expected = len(self.prompt_ids) + len(self.response_ids) - 1
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != expected:
                raise ValueError(
                    f"routed_experts has shape {self.routed_experts.shape}, expected ({expected}, moe_layers, top_k)"
                )
