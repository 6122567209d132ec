"""Log-probs at chosen ids, and the top-k of a distribution, from vocab-parallel logits (top-k distillation,
``algorithms.distillation`` eq. 3), without gathering the vocabulary.

Both reuse the log-probs of the sampled tokens that ``next_token_logprobs_and_entropy`` already computed:
at temperature 1, ``log π(v) = x_v − logsumexp(x) = log π(y) − x_y + x_v`` for the sampled token ``y``, so the
normaliser is not computed again; the only communication is one all-reduce of ``[tokens, 1 + k]`` gathered logits
(and, for the top-k, one all-gather of each shard's ``k`` candidates).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["next_token_logprobs_at", "next_token_topk"]


def _group(tp_group: ProcessGroup | None) -> ProcessGroup | None:
    return tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None


def _gather_columns(logits: Tensor, ids: Tensor, tp_group: ProcessGroup | None) -> Tensor:
    """``logits[..., ids]`` in fp32 for global ``ids`` ``[..., m]`` from this rank's shard ``[..., V_local]``.
    Differentiable: the gradient reaches this rank's own columns (each rank computes the same loss and
    back-propagates into its own shard, as Megatron's vocab-parallel cross-entropy does)."""
    v_local = logits.shape[-1]
    start = dist.get_rank(tp_group) * v_local if tp_group is not None else 0
    local = ids - start
    here = (local >= 0) & (local < v_local)
    own = torch.where(here, logits.gather(-1, local.clamp(0, v_local - 1)).float(), 0.0)
    if tp_group is None:
        return own
    total = own.detach().clone()
    dist.all_reduce(total, group=tp_group)
    return own + (total - own.detach())


def next_token_logprobs_at(
    logits: Tensor,
    input_ids: Tensor,
    log_probs: Tensor,
    ids: Tensor,
    *,
    tp_group: ProcessGroup | None = None,
    valid_vocab_size: int | None = None,
) -> Tensor:
    """``[b, s, k]``: ``log softmax(logits[:, t-1])[ids[:, t, j]]`` aligned with ``input_ids`` (position 0 is 0),
    from a causal model's logits ``[b, s, V_local]`` (temperature 1) and ``log_probs`` ``[b, s]`` =
    ``next_token_logprobs_and_entropy(logits, input_ids)``'s; differentiable through both. An id from
    ``valid_vocab_size`` on (the padding of a padded vocabulary: no token's logit) is refused."""
    if valid_vocab_size is not None and ids.numel() and int(ids.max()) >= valid_vocab_size:
        raise ValueError(
            f"the teacher's top-k names token id {int(ids.max())}, beyond the student's vocabulary of "
            f"{valid_vocab_size}: use a teacher whose vocabulary (config.json vocab_size) is the student's, or "
            "algo.distill.top_k=0"
        )
    group = _group(tp_group)
    device = logits.device
    columns = torch.cat([input_ids.to(device)[:, 1:, None], ids.to(device)[:, 1:]], dim=-1)
    x = _gather_columns(logits[:, :-1], columns, group)
    out = log_probs[:, 1:, None] - x[..., :1] + x[..., 1:]
    return torch.nn.functional.pad(out, (0, 0, 1, 0))


@torch.no_grad()
def next_token_topk(
    logits: Tensor,
    input_ids: Tensor,
    log_probs: Tensor,
    k: int,
    *,
    tp_group: ProcessGroup | None = None,
    valid_vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely next tokens at each position and their log-probs (``[b, s, k]`` ids and fp32
    log-probs, most likely first, aligned with ``input_ids``; position 0 is 0), from logits ``[b, s, V_local]``
    (temperature 1) and their sampled-token ``log_probs`` ``[b, s]``. Columns from ``valid_vocab_size`` on
    (the padding of a padded vocabulary) are never chosen."""
    group = _group(tp_group)
    x = logits[:, :-1].float()
    v_local = x.shape[-1]
    start = dist.get_rank(group) * v_local if group is not None else 0
    if valid_vocab_size is not None and start + v_local > valid_vocab_size:
        x = x.clone()
        x[..., max(valid_vocab_size - start, 0) :] = -torch.inf
    values, local = x.topk(min(k, v_local), dim=-1)
    ids = local + start
    if group is not None:
        size = dist.get_world_size(group)
        values_all = [torch.empty_like(values) for _ in range(size)]
        ids_all = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(values_all, values.contiguous(), group=group)
        dist.all_gather(ids_all, ids.contiguous(), group=group)
        values, order = torch.cat(values_all, -1).topk(k, dim=-1)
        ids = torch.cat(ids_all, -1).gather(-1, order)
    target = _gather_columns(logits[:, :-1], input_ids.to(logits.device)[:, 1:, None], group)
    top_log_probs = log_probs[:, 1:, None] - target + values
    pad = (0, 0, 1, 0)
    return torch.nn.functional.pad(ids, pad), torch.nn.functional.pad(top_log_probs, pad)
