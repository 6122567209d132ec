"""The supervised warm-up stage before RL: `warmup.sft_steps` steps on prompt -> answer pairs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.schema import RLConfig
from megatron_rl.megatron_backend.actor import MegatronActor
from megatron_rl.megatron_backend.batch import TokenBatch


def supervised_warmup(cfg: RLConfig, actor: MegatronActor, data: Any) -> None:
    """`warmup.sft_steps` steps at `warmup.sft_lr` on the synthetic task's SFT split (multi-turn pairs train
    their model turns only); the LR schedule of the RL stage does not move."""
    from tqdm import tqdm

    w = cfg.warmup
    bar = tqdm(range(w.sft_steps), desc="supervised warm-up", disable=dist.get_rank() != 0)
    for k in bar:
        pairs = data.sft_pairs(w.sft_batch_size, start=k * w.sft_batch_size)
        metrics = actor.warmup_step(pairs_to_batch(pairs), sft_loss, lr=w.sft_lr)
        bar.set_postfix(nll=f"{metrics['sft/nll']:.3f}")


def pairs_to_batch(pairs: list) -> TokenBatch:
    """Right-padded prompt + response rows; `fields["loss_mask"]` is 1 on the response tokens that train (all of
    them, or where a multi-turn pair's `loss_mask` is 1: its observations are not trained)."""
    lengths = [len(p.prompt_ids) + len(p.response_ids) for p in pairs]
    ids = torch.zeros(len(pairs), max(lengths), dtype=torch.long)
    loss_mask = torch.zeros(len(pairs), max(lengths))
    for i, p in enumerate(pairs):
        ids[i, : lengths[i]] = torch.tensor(p.prompt_ids + p.response_ids)
        start = len(p.prompt_ids)
        loss_mask[i, start : lengths[i]] = 1.0 if p.loss_mask is None else torch.tensor(p.loss_mask, dtype=torch.float)
    starts = torch.tensor([len(p.prompt_ids) for p in pairs])
    return TokenBatch(ids, torch.tensor(lengths), starts, fields={"loss_mask": loss_mask})


def sft_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: TokenBatch):
    """The warm-up's loss (`batch.LossFn`): mean negative log-likelihood of the trained response tokens
    (`fields["loss_mask"]` of `pairs_to_batch`)."""
    mask = mb.fields["loss_mask"].to(log_probs.device)
    count = mask.sum().to(torch.int)
    nll = -(log_probs * mask).sum()
    return nll, count, {"sft/nll": float(nll.detach() / count.clamp(min=1))}
