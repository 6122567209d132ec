"""The token batch the actor consumes, and its split into micro-batches by a token budget."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    def response_mask(self) -> torch.Tensor:
        """`[batch, seq]` bool: True at response tokens (the positions whose log-probs train the policy)."""
        pos = torch.arange(self.input_ids.shape[1]).unsqueeze(0)
        return (pos >= self.response_start.unsqueeze(1)) & (pos < self.lengths.unsqueeze(1))

    def select(self, index: list[int], *, pad_to_multiple: int = 1) -> TokenBatch:
        """Rows `index`, trimmed to their longest sequence (rounded up to `pad_to_multiple`)."""
        idx = torch.tensor(index, dtype=torch.long)
        lengths = self.lengths[idx]
        seq = int(lengths.max())
        seq = -(-seq // pad_to_multiple) * pad_to_multiple
        seq_total = self.input_ids.shape[1]
        ids = self.input_ids[idx, : min(seq, seq_total)]
        if seq > seq_total:
            ids = torch.nn.functional.pad(ids, (0, seq - seq_total))

        def trim(t: torch.Tensor) -> torch.Tensor:
            t = t[idx, : min(seq, seq_total)]
            if seq > seq_total:
                t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, seq - seq_total))
            return t

        return TokenBatch(
            input_ids=ids,
            lengths=lengths,
            response_start=self.response_start[idx],
            fields={k: trim(v) for k, v in self.fields.items()},
            routes=None if self.routes is None else trim(self.routes),
        )


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
