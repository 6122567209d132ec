"""The RL loss handed to `MegatronActor.train_step`: policy loss + KL to reference + entropy bonus (+ top-k
distillation's KL to the teacher, `algorithms.distillation` eq. 3).

Built once from `AlgoConfig`; per micro-batch it returns `(loss_sum, count, metrics)` where
`loss_sum / count` is that micro-batch's aggregated loss, so Megatron's global normalisation (the sum
of counts over micro-batches and data-parallel ranks) reproduces the exact global aggregation:
`count` is the number of valid tokens for `token-mean` and of non-empty sequences otherwise.
"""

from __future__ import annotations

from typing import Literal, cast

import torch

from megatron_rl.algorithms import aggregate, correction_stats, kl_penalty, policy_loss, rollout_correction_weights
from megatron_rl.algorithms.distillation import sequence_mean, topk_kl
from megatron_rl.algorithms.gae import ADVANTAGE as GAE
from megatron_rl.algorithms.masking import masked_mean
from megatron_rl.config.algo import AlgoConfig
from megatron_rl.kernels import GSPOImpl, GSPOVariant, packed_gspo_loss, select_gspo_kernel
from megatron_rl.megatron_backend.actor.batch import LossFn, TokenBatch


def build_rl_loss(algo: AlgoConfig) -> LossFn:
    distill = algo.distill
    with_topk = distill.teacher is not None and distill.top_k > 0 and distill.top_k_coef > 0

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: TokenBatch, topk_log_probs=None):
        device = log_probs.device
        mask = mb.fields["loss_mask"].to(device)
        old = mb.fields["old_log_probs"].to(device)
        adv = mb.fields["advantages"].to(device)
        if algo.loss == "gspo" and (algo.distill.teacher is not None or algo.advantage == GAE):  # per token: mean
            adv = sequence_mean(adv, mask)
        weights = None
        if algo.rollout_correction != "none":
            weights = rollout_correction_weights(
                old,
                mb.fields["rollout_log_probs"].to(device),
                mask,
                level=algo.rollout_correction_level,
                mode=algo.rollout_correction,
                cap=algo.rollout_correction_cap,
                low=algo.rollout_correction_low,
                high=algo.rollout_correction_high,
            )
        kernel = gspo_kernel(algo, log_probs)
        if kernel == "reference":
            loss, metrics = policy_loss(
                algo.loss,
                log_probs,
                old,
                adv,
                mask,
                agg=algo.agg,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                clip_c=algo.clip_c,
                tau_pos=algo.tau_pos,
                tau_neg=algo.tau_neg,
                agg_norm=algo.agg_norm,
                rollout_weights=weights,
            )
        else:
            loss, metrics = _packed_gspo(algo, kernel, log_probs, old, adv, mask, weights)
        if weights is not None:
            rollout = mb.fields["rollout_log_probs"].to(device)
            metrics.update(correction_stats(weights, old, rollout, mask, level=algo.rollout_correction_level))
        out = {f"actor/{k}": float(v) for k, v in metrics.items()}
        out["actor/pg_loss"] = float(loss.detach())
        if algo.kl_coef > 0 and not algo.kl_in_reward:  # else the critic's rewards hold the KL (critic_phase)
            kl = kl_penalty(log_probs, mb.fields["ref_log_probs"].to(device), algo.kl_estimator, response_mask=mask)
            kl_loss = aggregate(kl, mask, algo.agg, norm=algo.agg_norm)
            loss = loss + algo.kl_coef * kl_loss
            out["actor/kl_ref"] = float(kl_loss.detach())
        if with_topk:
            if topk_log_probs is None:
                raise RuntimeError(
                    "algo.distill.top_k is set but this micro-batch carries no teacher top-k ids (teacher_topk_ids)"
                )
            teacher = mb.fields["teacher_topk_log_probs"].to(device)
            topk_loss = aggregate(topk_kl(teacher, topk_log_probs), mask, algo.agg, norm=algo.agg_norm)
            loss = loss + distill.top_k_coef * topk_loss
            out["distill/topk_kl"] = float(topk_loss.detach())
        if entropy is not None:
            ent = aggregate(entropy, mask, algo.agg, norm=algo.agg_norm)
            out["actor/entropy"] = float(ent.detach())
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * ent
        return _as_sum(loss, mask, algo.agg, real_rows=mb.size - mb.padding_rows), out

    def with_count(log_probs, entropy, mb, **topk):
        (loss_sum, count), out = loss_fn(log_probs, entropy, mb, **topk)
        return loss_sum, count, out

    return with_count


def gspo_kernel(algo: AlgoConfig, log_probs: torch.Tensor) -> Literal["reference", "torch", "triton"]:
    """``reference``, ``torch`` or ``triton``: the implementation ``algo.gspo_kernel`` stands for here."""
    return select_gspo_kernel(algo.gspo_kernel, log_probs, loss=algo.loss, agg=algo.agg)


def _packed_gspo(algo: AlgoConfig, kernel: GSPOImpl, log_probs, old, adv, mask, weights):
    """``packed_gspo_loss`` on the micro-batch's rows (one packed sequence per row), with ``policy_loss``'s
    metrics: clip fractions from the kernel, ``ppo_kl`` and the sequence-ratio statistics over valid tokens."""
    b, s = log_probs.shape
    valid = mask > 0
    cu_seqlens = torch.arange(0, b * s + 1, s, device=log_probs.device)
    # A packed kernel is chosen only for gspo/gspo_token (config validation; packed_gspo_loss checks it again).
    out = packed_gspo_loss(
        log_probs.reshape(-1), old.reshape(-1), adv.reshape(-1), cu_seqlens, valid.reshape(-1),
        clip_low=algo.clip_low, clip_high=algo.clip_high, variant=cast(GSPOVariant, algo.loss),
        rollout_weights=None if weights is None else weights.reshape(-1), impl=kernel,
    )  # fmt: skip
    with torch.no_grad():
        rows = valid.any(-1)
        ratio = out.seq_ratio.float()
        tokens = valid.sum(-1).float()
        any_valid = bool(rows.any())
        metrics = {
            "clip_frac_low": out.clip_frac_low,
            "clip_frac_high": out.clip_frac_high,
            "clip_frac_dual": torch.zeros(()),
            "ppo_kl": masked_mean((old - log_probs).float(), valid),
            "ratio_mean": (ratio * tokens).sum() / tokens.sum() if any_valid else torch.ones(()),
            "ratio_max": ratio[rows].max() if any_valid else torch.ones(()),
            "ratio_min": ratio[rows].min() if any_valid else torch.ones(()),
        }
    return out.loss, metrics


def _as_sum(loss: torch.Tensor, mask: torch.Tensor, agg: str, *, real_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) such that numerator / denominator == `loss` for this micro-batch and the
    sums over micro-batches and ranks give the global aggregation (see `aggregate` for the modes)."""
    valid = mask > 0
    if agg == "token-mean":
        count = valid.sum()
        return loss * count, count.to(torch.int)
    if agg == "seq-mean-token-sum-norm":  # aggregate divides by norm * rows (padding rows included)
        return loss * mask.shape[0], torch.tensor(real_rows, dtype=torch.int)
    count = (valid.sum(-1) > 0).sum()
    return loss * count, count.to(torch.int)
