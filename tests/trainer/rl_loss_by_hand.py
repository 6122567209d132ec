"""The trainer's RL loss written out by hand in float64: value, normaliser and analytic gradient.

One step's loss is the global aggregation of docs/algorithms.md over the whole batch,
``L = Σ_bt c_bt · m_bt · (w_bt · pg_bt + β · k3_bt - γ · H_bt)``: the PPO clip surrogate ``pg``, the TIS weight
``w = min(π_old/π_rollout, C)`` (per token, or the product over the response), the k3 KL to the reference and
the entropy ``H``. The aggregation mode only sets the coefficient ``c_bt``: 1/N (tokens), 1/S (non-empty
responses), 1/(S·n_b), or 1/(L_max·B) for Dr. GRPO (B = every real sample, empty ones included).
Independent of `megatron_rl.algorithms` on purpose: the tests compare the trainer's code with this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.config import load_config
from megatron_rl.config.algo import AlgoConfig

L_MAX = 24  # rollout.sampling.max_new_tokens: Dr. GRPO's constant normaliser
KL_COEF, ENTROPY_COEF, TIS_CAP, CLIP_LOW, CLIP_HIGH = 0.05, 0.03, 1.5, 0.2, 0.28
PRESET_OF = {  # aggregation mode -> a published preset that uses it (Dr. GRPO's agg_norm comes from L_MAX)
    "token-mean": "dapo",
    "seq-mean-token-sum": "grpo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}


def rl_algo(agg: str, level: str) -> AlgoConfig:
    """The preset of `agg` with the PPO clip, KL, entropy bonus and TIS (at `level`) of the constants above."""
    overrides = [
        "model.hf_path=unused",
        f"algo.preset={PRESET_OF[agg]}",
        f"rollout.sampling.max_new_tokens={L_MAX}",
        "algo.loss=ppo",
        f"algo.agg={agg}",
        f"algo.clip_low={CLIP_LOW}",
        f"algo.clip_high={CLIP_HIGH}",
        f"algo.kl_coef={KL_COEF}",
        "algo.kl_estimator=k3",
        f"algo.entropy_coef={ENTROPY_COEF}",
        "algo.rollout_correction=tis",
        f"algo.rollout_correction_level={level}",
        f"algo.rollout_correction_cap={TIS_CAP}",
        "algo.dynamic_sampling=false",
        "algo.overlong_buffer=0",
    ]
    algo = load_config(None, overrides).algo
    assert algo.agg_norm == (L_MAX if agg == "seq-mean-token-sum-norm" else None)
    assert algo.clip_c is None
    return algo


@dataclass
class HandStep:
    loss: float
    count: int  # the normaliser: tokens, non-empty responses or samples
    grad_log_probs: torch.Tensor  # ∂L/∂log_probs, [batch, seq]
    grad_entropy: torch.Tensor  # ∂L/∂entropy, [batch, seq]
    truncated: int  # valid tokens whose TIS weight was truncated at the cap
    clipped: int  # valid tokens whose PPO clip is active (zero policy gradient)


def hand_step(
    agg: str, level: str, fields: dict[str, torch.Tensor], log_probs: torch.Tensor, entropy: torch.Tensor
) -> HandStep:
    """The loss of `rl_algo(agg, level)` over a whole batch (every row a real sample), without autograd."""
    m = fields["loss_mask"] > 0
    lp, ent = log_probs.double(), entropy.double()
    old, adv = fields["old_log_probs"].double(), fields["advantages"].double()
    n_b = m.sum(-1).double()
    tokens, seqs, rows = int(m.sum()), int((n_b > 0).sum()), m.shape[0]
    coef, count = {
        "token-mean": (torch.full_like(lp, 1 / tokens), tokens),
        "seq-mean-token-sum": (torch.full_like(lp, 1 / seqs), seqs),
        "seq-mean-token-mean": ((1 / (seqs * n_b.clamp(min=1))).unsqueeze(-1).expand_as(lp), seqs),
        "seq-mean-token-sum-norm": (torch.full_like(lp, 1 / (L_MAX * rows)), rows),
    }[agg]
    coef = torch.where(m, coef, 0.0)

    log_w = torch.where(m, old - fields["rollout_log_probs"].double(), 0.0)
    if level == "sequence":  # product of the token ratios of the response
        log_w = log_w.sum(-1, keepdim=True).expand_as(lp)
    w = log_w.exp().clamp(max=TIS_CAP)
    ratio = torch.where(m, lp - old, 0.0).exp()
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    clipped = ((adv > 0) & (ratio > 1 + CLIP_HIGH)) | ((adv < 0) & (ratio < 1 - CLIP_LOW))
    d_pg = torch.where(clipped, 0.0, -adv * ratio)  # ∂pg/∂log π
    d = torch.where(m, fields["ref_log_probs"].double() - lp, 0.0)
    kl, d_kl = d.exp() - d - 1, 1 - d.exp()  # k3 and ∂k3/∂log π

    return HandStep(
        loss=float((coef * (w * pg + KL_COEF * kl - ENTROPY_COEF * ent)).sum()),
        count=count,
        grad_log_probs=coef * (w * d_pg + KL_COEF * d_kl),
        grad_entropy=-ENTROPY_COEF * coef,
        truncated=int((m & (w == TIS_CAP)).sum()),
        clipped=int((m & clipped).sum()),
    )
