"""Published algorithms as values of the ``algo`` section, picked by name with ``algo.preset``.

A preset is applied on top of the defaults and under every key the user sets explicitly, so
``algo.preset=dapo algo.clip_high=0.3`` is DAPO with another eps_high. Each preset states every key
that defines the algorithm (loss, clip range, aggregation, advantages, KL, DAPO shaping), even where
it equals the default, so a later change of a default cannot change a published algorithm.

Values that depend on the generation cap are ``OfMaxNewTokens`` and resolve against the final
``rollout.sampling.max_new_tokens``. The mapping of each paper onto the loss functions, and where
the peers (verl, slime, TRL) differ, is in docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OfMaxNewTokens:
    """A preset value equal to ``fraction * rollout.sampling.max_new_tokens`` (rounded to an integer)."""

    fraction: float

    def resolve(self, max_new_tokens: int) -> int:
        return max(1, round(self.fraction * max_new_tokens))

    def __str__(self) -> str:
        return f"{self.fraction:g} * rollout.sampling.max_new_tokens"


# The keys every preset sets.
CORE_KEYS = (
    "loss",
    "clip_low",
    "clip_high",
    "clip_c",
    "agg",
    "agg_norm",
    "advantage",
    "norm_adv_by_std",
    "kl_coef",
    "kl_estimator",
    "dynamic_sampling",
    "overlong_buffer",
    "overlong_filter",
)

_NO_SHAPING = {"dynamic_sampling": False, "overlong_buffer": 0, "overlong_filter": False}
_NO_KL = {"kl_coef": 0.0, "kl_estimator": "k3"}
_GROUP_ADV = {"advantage": "grpo", "norm_adv_by_std": True}
_GAE_ADV = {"advantage": "gae", "norm_adv_by_std": True}  # norm_adv_by_std: unused by gae
# verl's critic defaults: GAE with gamma = lambda = 1 for actor and critic, value clip 0.5, whitened advantages.
_VERL_CRITIC = {"gamma": 1.0, "lam": 1.0, "lam_actor": None, "lam_actor_alpha": 0.0, "value_clip": 0.5, "whiten": True}
# DAPO: L_max = 20480 generated tokens with a 4096-token soft-penalty buffer, i.e. the last 20 %.
_DAPO_SHAPING = {
    "dynamic_sampling": True,
    "overlong_buffer": OfMaxNewTokens(4096 / 20480),
    "overlong_penalty_factor": 1.0,
    "overlong_filter": False,  # DAPO's best runs use the soft penalty without overlong filtering
}

PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    # DeepSeekMath, arXiv 2402.03300 eq. 3-4 and §4.2: PPO clip, per-sequence token mean, k3 KL in the loss
    # with beta = 0.04, group mean/std advantages.
    "grpo": {
        "loss": "ppo",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_c": None,
        "agg": "seq-mean-token-mean",
        "agg_norm": None,
        **_GROUP_ADV,
        "kl_coef": 0.04,
        "kl_estimator": "k3",
        **_NO_SHAPING,
    },
    # DAPO, arXiv 2503.14476 eq. 8-13: Clip-Higher 0.2/0.28, token-level loss, no KL, dynamic sampling,
    # soft overlong punishment.
    "dapo": {
        "loss": "ppo",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "clip_c": None,
        "agg": "token-mean",
        "agg_norm": None,
        **_GROUP_ADV,
        **_NO_KL,
        **_DAPO_SHAPING,
    },
    # GSPO, arXiv 2507.18071 eq. 5-7: sequence-level ratio clipped at 3e-4/4e-4, per-sequence mean, no KL.
    "gspo": {
        "loss": "gspo",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "clip_c": None,
        "agg": "seq-mean-token-mean",
        "agg_norm": None,
        **_GROUP_ADV,
        **_NO_KL,
        **_NO_SHAPING,
    },
    # SAPO, arXiv 2511.20347: sigmoid soft gate with tau_pos = 1.0, tau_neg = 1.05, per-sequence mean, no KL.
    # The clip range is unused by the sapo loss.
    "sapo": {
        "loss": "sapo",
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_c": None,
        "agg": "seq-mean-token-mean",
        "agg_norm": None,
        **_GROUP_ADV,
        **_NO_KL,
        **_NO_SHAPING,
    },
    # Dr. GRPO, arXiv 2503.20783 §3: no std division, token sum over B * L_max (a constant), no KL.
    "dr_grpo": {
        "loss": "ppo",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_c": None,
        "agg": "seq-mean-token-sum-norm",
        "agg_norm": OfMaxNewTokens(1.0),
        "advantage": "dr_grpo",
        "norm_adv_by_std": False,
        **_NO_KL,
        **_NO_SHAPING,
    },
    # CISPO, MiniMax-M1 arXiv 2506.13585 eq. 4-5: clipped IS weight times log-prob, token-level loss, no KL,
    # no lower bound (clip_low >= 1), eps_high 4.0 (weight cap 5, as ScaleRL and slime); with DAPO's
    # dynamic sampling and length penalty, as the paper trains.
    "cispo": {
        "loss": "cispo",
        "clip_low": 1.0,
        "clip_high": 4.0,
        "clip_c": None,
        "agg": "token-mean",
        "agg_norm": None,
        **_GROUP_ADV,
        **_NO_KL,
        **_DAPO_SHAPING,
    },
    # PPO with a learned critic (Schulman et al., arXiv 1707.06347; Ouyang et al., InstructGPT, arXiv 2203.02155),
    # as verl runs it by default: GAE with gamma = lambda = 1, value clip 0.5, whitened advantages, no KL.
    "ppo": {
        "loss": "ppo",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_c": None,
        "agg": "token-mean",
        "agg_norm": None,
        **_GAE_ADV,
        **_NO_KL,
        **_NO_SHAPING,
        "critic": _VERL_CRITIC,
    },
    # VAPO, arXiv 2504.05118 §3-4: decoupled GAE (lambda_critic = 1.0 eq. 6, length-adaptive lambda_policy =
    # 1 - 1/(alpha l) with alpha = 0.05, eq. 7), 50 value pre-training steps, Clip-Higher 0.2/0.28, token-level
    # loss, no KL. Its positive-example LM loss and group sampling are not part of the preset.
    "vapo": {
        "loss": "ppo",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "clip_c": None,
        "agg": "token-mean",
        "agg_norm": None,
        **_GAE_ADV,
        **_NO_KL,
        **_NO_SHAPING,
        "critic": {**_VERL_CRITIC, "lam_actor_alpha": 0.05, "warmup_steps": 50},
    },
}


def preset_values(name: str, max_new_tokens: int | None = None) -> dict[str, Any]:
    """The ``algo`` keys preset ``name`` sets; with ``max_new_tokens``, `OfMaxNewTokens` values resolved."""
    values = dict(PRESETS[name])
    if max_new_tokens is not None:
        values = {k: v.resolve(max_new_tokens) if isinstance(v, OfMaxNewTokens) else v for k, v in values.items()}
    return values
