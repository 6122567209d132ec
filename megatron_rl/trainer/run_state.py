"""Where a start of a run continues from, kept in every checkpoint (`trainer_state.json`'s `trainer` entry)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class RunState:
    """The run's position: saved with each checkpoint and read back on resume."""

    step: int = 0  # the last RL step done
    sft_done: bool = False  # the supervised warm-up is complete
    sft_step: int = 0  # the warm-up step a mid-warm-up checkpoint was taken after
    data: dict[str, Any] | None = None  # the prompt stream's position
    metrics_row: dict[str, float] | None = None  # step `step`'s row, restored into metrics.jsonl on resume
    queued: list[dict[str, Any]] = field(default_factory=list)  # async mode: generated batches not trained on yet

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> RunState:
        """The state a checkpoint saved (keys it lacks take their defaults: checkpoints before a key existed)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known and v is not None})

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain JSON data)."""
        return asdict(self)
