"""A step's advantages, and rollout `Sample`s turned into the actor's `TokenBatch` (right-padded, per-token fields
aligned)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megatron_rl.algorithms import compute_advantages
from megatron_rl.algorithms.advantages import estimator_options
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.rollout.sample import Sample
from megatron_rl.routing.cache import padding_routes


def step_advantages(algo: Any, rewards: list[float], group_size: int) -> torch.Tensor:
    """Every sample's advantage (`[n]`) under `algo.advantage` from the step's `rewards`, in groups of `group_size`
    (a prompt's samples), with `algo.norm_adv_by_std` where the estimator takes it."""
    options = estimator_options(algo.advantage, norm_by_std=algo.norm_adv_by_std)
    return compute_advantages(algo.advantage, torch.tensor(rewards, dtype=torch.float32), group_size, **options)


def samples_to_batch(samples: list[Sample], *, advantages: torch.Tensor, with_routes: bool = False) -> TokenBatch:
    """Fields: `advantages` (per sample, broadcast over its tokens), `rollout_log_probs` (the engine's),
    `loss_mask` (response tokens, zero for samples excluded from the loss), the teacher's fields
    (`_teacher_fields`) when the samples carry an engine-served teacher's scores. With `with_routes`, the
    samples' `routed_experts` (SGLang layout) become `batch.routes`; the last position gets dummy
    experts, as it is never fed in SGLang's layout and its output never reaches a log-prob."""
    if not samples:
        raise ValueError("no samples to train on")
    lengths = [len(s.tokens) for s in samples]
    longest = max(lengths)
    b = len(samples)
    ids = torch.zeros(b, longest, dtype=torch.long)
    rollout_logp = torch.zeros(b, longest)
    loss_mask = torch.zeros(b, longest)
    routes = None
    if with_routes:
        first = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
        if first is None:
            raise ValueError("routing replay R3 needs routed_experts from the rollout engine")
        layers, k = first.shape[1:]
        routes = padding_routes(b, longest, layers, k, torch.int16)
    for i, s in enumerate(samples):
        n, start = lengths[i], len(s.prompt_ids)
        ids[i, :n] = torch.tensor(s.tokens)
        rollout_logp[i, start:n] = torch.tensor(s.response_log_probs, dtype=torch.float32)
        if not s.metadata.get("exclude_from_loss") and not getattr(s, "exclude_from_loss", False):
            loss_mask[i, start:n] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        if routes is not None:
            if s.routed_experts is None:
                raise ValueError(f"sample {i} has no routed_experts but routing replay R3 is on")
            routes[i, : n - 1] = torch.from_numpy(np.asarray(s.routed_experts, dtype=np.int16))
    fields = {
        "advantages": advantages.float().view(b, 1).expand(b, longest).contiguous(),
        "rollout_log_probs": rollout_logp,
        "loss_mask": loss_mask,
    }
    fields.update(_teacher_fields(samples, longest))
    return TokenBatch(
        input_ids=ids,
        lengths=torch.tensor(lengths),
        response_start=torch.tensor([len(s.prompt_ids) for s in samples]),
        fields=fields,
        routes=routes,
    )


def _teacher_fields(samples: list[Sample], longest: int) -> dict[str, torch.Tensor]:
    """Distillation by an engine-served teacher: `teacher_log_probs` `[n, T]` and, with top-k, `teacher_topk_ids`
    and `teacher_topk_log_probs` `[n, T, k]` (position t: token t given tokens[:t]); none without a teacher."""
    out: dict[str, torch.Tensor] = {}
    for name, dtype in [("teacher_log_probs", torch.float32), ("teacher_topk_ids", torch.long),
                        ("teacher_topk_log_probs", torch.float32)]:  # fmt: skip
        rows = [getattr(s, name) for s in samples]
        if all(r is None for r in rows):
            continue
        values = [torch.tensor(r, dtype=dtype) for r in rows if r is not None]
        if len(values) < len(rows):
            raise ValueError(f"sample {rows.index(None)} has no {name} but others of its batch do")
        field = torch.zeros(len(rows), longest, *values[0].shape[1:], dtype=dtype)
        for i, v in enumerate(values):
            field[i, 1 : 1 + len(v)] = v
        out[name] = field
    return out


def select(batch: TokenBatch, index: list[int]) -> TokenBatch:
    """A mini-batch of rows (keeps the full padded width, so fields stay aligned)."""
    idx = torch.tensor(index)
    return TokenBatch(
        input_ids=batch.input_ids[idx],
        lengths=batch.lengths[idx],
        response_start=batch.response_start[idx],
        fields={k: v[idx] for k, v in batch.fields.items()},
        routes=None if batch.routes is None else batch.routes[idx],
    )
