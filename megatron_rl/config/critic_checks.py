"""Load-time checks of PPO with a critic (`algo.advantage: gae`, `algo.critic`, `algo.kl_in_reward`)."""

from __future__ import annotations

from typing import Any

from megatron_rl.algorithms.gae import ADVANTAGE as GAE


def check_critic(cfg: Any, errors: list[str], notes: list[str]) -> None:
    algo = cfg.algo
    critic = algo.critic
    if algo.kl_in_reward and algo.advantage != GAE:
        errors.append(
            f"algo.kl_in_reward=true needs algo.advantage=gae (a per-token reward needs a critic's GAE), not "
            f"{algo.advantage!r}; keep the KL in the loss (kl_in_reward=false)"
        )
    if algo.kl_in_reward and algo.kl_coef <= 0:
        errors.append("algo.kl_in_reward=true with algo.kl_coef=0 adds nothing: set algo.kl_coef > 0")
    if algo.advantage != GAE:
        if critic.warmup_steps or critic.hf_path:
            notes.append(f"algo.critic is unused with algo.advantage={algo.advantage!r} (set gae to train a critic)")
        return
    if algo.distill.teacher is not None:
        errors.append(
            "algo.advantage=gae with algo.distill.teacher: distillation's per-token advantages are not combined with "
            "a critic's; use a group estimator (grpo) with distillation, or drop the teacher"
        )
    if critic.lam_actor is not None and critic.lam_actor_alpha > 0:
        notes.append(
            f"algo.critic.lam_actor={critic.lam_actor} is unused: lam_actor_alpha={critic.lam_actor_alpha} makes the "
            "actor's λ length-adaptive"
        )
    where = critic.hf_path or "the policy's checkpoint with a fresh value head"
    notes.append(
        f"algo.advantage=gae: a critic ({where}) trains in the actor's parallel layout, lr {critic.lr:g}"
        + (f", {critic.warmup_steps} critic-only warm-up steps first" if critic.warmup_steps else "")
    )
