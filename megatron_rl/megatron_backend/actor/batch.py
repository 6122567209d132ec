"""The token batch the actor consumes, and its split into micro-batches by a token budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import overload

import torch

from megatron_rl.megatron_backend.actor.packing import Packing
from megatron_rl.routing.cache import padding_routes


@dataclass(frozen=True)
class DPShare:
    """Marks a batch that holds only this data-parallel rank's rows of a mini-batch, in the order the rank feeds
    them (`trainer.step.step_plan`), instead of the whole mini-batch: the actor scores and trains them as they are."""

    imbalance: float = 1.0  # the mini-batch's max / mean tokens per data-parallel rank


@dataclass
class TokenBatch:
    """Right-padded sequences (prompt + response) and per-token fields aligned with `input_ids`.

    Per-token fields (`old_log_probs`, `advantages`, ...) are `[batch, seq]` tensors in which position t
    refers to token `input_ids[:, t]` (its log-prob is log p(input_ids[t] | input_ids[:t])).
    `routes` (optional, for routing replay) is `[batch, seq, moe_layers, top_k]`: the experts each MoE
    layer chose for the token at each position.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    response_start: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    routes: torch.Tensor | None = None
    padding_rows: int = 0  # trailing dummy rows added to give every micro-batch the same shape
    packing: Packing | None = None  # set on a micro-batch the model sees packed (its rows end to end in one row)
    dp_share: DPShare | None = None  # set when the batch is only this data-parallel rank's rows of a mini-batch

    def __post_init__(self) -> None:
        b, s = self.input_ids.shape
        if self.lengths.shape != (b,) or self.response_start.shape != (b,):
            raise ValueError(f"lengths and response_start must have shape ({b},)")
        if bool((self.lengths > s).any()) or bool((self.response_start < 1).any()):
            raise ValueError("each sequence needs 1 <= response_start and length <= the padded sequence length")
        if bool((self.response_start > self.lengths).any()):
            raise ValueError("response_start beyond the sequence length")
        for name, value in self.fields.items():
            if value.shape[:2] != (b, s):
                raise ValueError(f"field {name!r} has shape {tuple(value.shape)}, expected ({b}, {s}, ...)")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def model_tokens(self) -> torch.Tensor:
        """The token ids the model sees: `input_ids`, or their packed row `[1, total]`."""
        return self.input_ids if self.packing is None else self.packing.pack(self.input_ids)

    @overload
    def per_sample(self, values: torch.Tensor) -> torch.Tensor: ...
    @overload
    def per_sample(self, values: None) -> None: ...
    def per_sample(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token model outputs (`[rows, seq, ...]` as the model saw them) in this batch's per-sample layout."""
        if values is None or self.packing is None:
            return values
        return self.packing.unpack(values, self.input_ids.shape[1])

    def response_mask(self) -> torch.Tensor:
        """`[batch, seq]` bool: True at response tokens (the positions whose log-probs train the policy)."""
        pos = torch.arange(self.input_ids.shape[1]).unsqueeze(0)
        return (pos >= self.response_start.unsqueeze(1)) & (pos < self.lengths.unsqueeze(1))

    def select(
        self, index: list[int], *, pad_to_multiple: int = 1, seq_len: int | None = None, rows: int | None = None
    ) -> TokenBatch:
        """Rows `index`, trimmed to their longest sequence (rounded up to `pad_to_multiple`).

        `seq_len` and `rows` force a fixed shape (pipeline stages exchange fixed-shape activations):
        missing rows are dummies with an empty response (`padding_rows` counts them).
        """
        idx = torch.tensor(index, dtype=torch.long)
        seq = seq_len if seq_len is not None else (int(self.lengths[idx].max()) if index else 1)
        seq = -(-seq // pad_to_multiple) * pad_to_multiple
        extra = 0 if rows is None else rows - len(index)
        if extra < 0:
            raise ValueError(f"rows={rows} is smaller than the {len(index)} selected samples")

        def fit(t: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
            t = t[idx, :seq]
            if t.shape[1] < seq:
                t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, seq - t.shape[1]), value=fill)
            if extra:
                t = torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)], dim=0)
            return t

        ones = torch.ones(extra, dtype=self.lengths.dtype)
        return TokenBatch(
            input_ids=fit(self.input_ids),
            lengths=torch.cat([self.lengths[idx], ones]),
            response_start=torch.cat([self.response_start[idx], ones]),
            fields={k: fit(v) for k, v in self.fields.items()},
            routes=None if self.routes is None else _with_dummy_routes(fit(self.routes), extra),
            padding_rows=extra,
        )


LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]
"""`loss_fn(log_probs, entropy, micro_batch) -> (loss_sum, count, metrics)`: the actor's loss contract; a
micro-batch with a `teacher_topk_ids` field (`[b, s, k]`, top-k distillation) also passes `topk_log_probs=`, the
policy's differentiable log-probs at those ids."""


def _with_dummy_routes(routes: torch.Tensor, extra: int) -> torch.Tensor:
    """The last `extra` (dummy) rows get `padding_routes`; they never reach a loss."""
    if extra:
        _, s, layers, k = routes.shape
        routes[-extra:] = padding_routes(extra, s, layers, k, routes.dtype)
    return routes


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of samples whose padded size (count x longest) stays within `max_tokens`.

    A single sample longer than the budget forms a micro-batch of its own.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
