"""The `algo` section: the loss, its clipping and aggregation, advantages, KL, rollout correction, dynamic
sampling, overlong shaping and routing replay (`algo.preset` fills it; docs/algorithms.md has the equations)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from megatron_rl.algorithms.gae import ADVANTAGE as GAE
from megatron_rl.algorithms.registry import NameSet
from megatron_rl.config.fields import setting

PresetName = Literal["none", "grpo", "dapo", "gspo", "sapo", "dr_grpo", "cispo", "ppo", "vapo"]


@dataclass(frozen=True)
class CriticConfig:
    """PPO with a learned critic (``algo.advantage: gae``): a value model in the actor's parallel layout, GAE
    advantages over the generated tokens and the clipped value loss (docs/algorithms.md, "PPO with a critic")."""

    hf_path: str | None = setting(
        None,
        help="HF checkpoint of the value model: the policy's family and tokenizer, any size; a reward model's "
        "score.weight (num_labels=1) becomes its value head; null = the policy's checkpoint with a fresh head",
    )
    lr: float = setting(
        1e-5,
        help="the critic's peak learning rate (the rest of its optimizer is `optimizer`'s); 0 = a frozen critic",
        ge=0,
    )
    warmup_steps: int = setting(
        0,
        help="rollout steps that train the critic alone before the actor's first update (VAPO's value pre-training); "
        "not counted in trainer.steps",
        ge=0,
    )
    gamma: float = setting(1.0, help="discount γ per generated token", ge=0, le=1)
    lam: float = setting(1.0, help="GAE λ of the critic's returns (VAPO: 1.0)", ge=0, le=1)
    lam_actor: float | None = setting(
        None, help="GAE λ of the actor's advantages (VAPO's decoupled λ); null = lam", ge=0, le=1
    )
    lam_actor_alpha: float = setting(
        0.0,
        help="> 0: the actor's λ adapts to each response's length l as 1 - 1/(alpha * l) (VAPO eq. 7, alpha = "
        "0.05), replacing lam_actor; 0 = off",
        ge=0,
    )
    value_clip: float | None = setting(
        0.5, help="value clip ε_v: the new value is kept within ε_v of the old one in the loss; null = no clip", gt=0
    )
    whiten: bool = setting(True, help="whiten the actor's advantages over the step's tokens (verl's masked_whiten)")


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation: a teacher scores every token the student sampled, and the per-token reverse KL
    ``log π_teacher(y_t) − log π_old(y_t)`` is added to the advantage (docs/algorithms.md, "On-policy
    distillation")."""

    teacher: str | None = setting(
        None,
        help="HF checkpoint of the teacher (its tokenizer must be the student's); null = no distillation",
    )
    served_by: Literal["megatron", "local_engine", "sglang"] = setting(
        "megatron",
        help="megatron = a frozen Megatron model in the trainer, in the actor's parallel layout, scoring in the "
        "scoring phase: with the student's architecture its weights wait on the host and are swapped in like the KL "
        "reference, else (another size or family of megatron_rl/models) it is a second model resident on the GPUs; "
        "local_engine = a transformers model on rank 0 (any family or size the local engine loads) that scores each "
        "rollout batch as it is collected; sglang = an SGLang server of the teacher scoring each batch by prefill "
        "(return_logprob), never sent weights",
    )
    sglang_urls: tuple[str, ...] = setting(
        (),
        help="served_by=sglang: running servers of the teacher (one, or a router: each URL scores the whole batch), "
        "with rollout.sglang's API key, or side:<name> (a rollout.side_models entry); empty = launch one on "
        "sglang_port with rollout.sglang's settings",
    )
    sglang_port: int = setting(30200, help="served_by=sglang: port of the launched teacher server", ge=1, le=65535)
    coef: float = setting(
        1.0, help="weight of the distillation advantage: A = A_task + coef * A_distill (0 = top-k term alone)", ge=0
    )
    top_k: int = setting(
        0,
        help="top-k distillation: the teacher also returns its top_k log-probs per position and the loss gains "
        "top_k_coef * KL(teacher's top-k renormalised || student at those ids); 0 = off",
        ge=0,
    )
    top_k_coef: float = setting(1.0, help="weight of the top-k distillation loss term", ge=0)
    task_rewards: bool = setting(
        True, help="keep the task rewards' advantage A_task; false = distillation alone (A = coef * A_distill)"
    )


@dataclass(frozen=True)
class AlgoConfig:
    """The RL objective: policy loss, aggregation, advantages, KL, rollout correction, DAPO shaping.

    ``preset`` fills this section with a published algorithm's values (``presets.py``); any key set
    explicitly in the YAML file or on the command line wins over the preset.
    """

    preset: PresetName = setting(
        "none",
        help="published algorithm whose values fill this section before explicit keys are applied "
        "(none = the defaults below); see presets.py",
    )
    loss: str = setting("ppo", help="policy loss (megatron_rl.algorithms.POLICY_LOSSES)", registry=POLICY_LOSSES)
    agg: str = setting(
        "token-mean",
        help="how per-token losses reduce to a scalar (verl's loss_agg_mode; megatron_rl.algorithms.AGGREGATIONS)",
        registry=AGGREGATIONS,
    )
    agg_norm: float | None = setting(
        None,
        help="constant normaliser of seq-mean-token-sum-norm (Dr. GRPO: the generation cap L_max); required "
        "with that mode, since the padded batch length would make the loss scale depend on padding",
        gt=0,
    )
    clip_low: float = setting(0.2, help="eps_low: ratio clipped below at 1 - clip_low (cispo: >= 1 = no bound)", ge=0)
    clip_high: float = setting(
        0.2, help="eps_high: ratio clipped above at 1 + clip_high (DAPO Clip-Higher: 0.28)", ge=0
    )
    clip_c: float | None = setting(
        None, help="dual-clip constant c > 1 for A < 0 (ppo loss only); null = no dual clip", gt=1
    )
    gspo_kernel: Literal["auto", "reference", "torch", "triton"] = setting(
        "auto",
        help="how loss=gspo/gspo_token with agg=seq-mean-token-mean is computed: reference = algorithms.policy_loss "
        "on the padded batch; torch / triton = the packed one-pass loss of megatron_rl.kernels (triton: compiled "
        "on GPU, TRITON_INTERPRET=1 on CPU); auto = triton for CUDA tensors when installed, reference otherwise",
    )
    tau_pos: float = setting(1.0, help="SAPO gate temperature for positive advantages", gt=0)
    tau_neg: float = setting(1.05, help="SAPO gate temperature for non-positive advantages", gt=0)
    advantage: str = setting(
        "grpo",
        help="advantage estimator: a group-relative one (megatron_rl.algorithms.ADVANTAGE_ESTIMATORS), or gae = a "
        "learned critic's values (algo.critic)",
        registry=NameSet(ADVANTAGE_ESTIMATORS, (GAE,)),
    )
    norm_adv_by_std: bool = setting(
        True,
        help="divide group-centred rewards by the group std (the grpo estimator's option; dr_grpo is grpo without it)",
    )
    kl_coef: float = setting(
        0.0,
        help="beta of the KL-to-reference term added to the loss (GRPO: 0.04); 0 = no reference model is built",
        ge=0,
    )
    kl_in_reward: bool = setting(
        False,
        help="with algo.advantage=gae: the KL to the reference is a per-token reward -kl_coef * (log π_old - log "
        "π_ref) (InstructGPT, verl's use_kl_in_reward) instead of a loss term",
    )
    kl_estimator: str = setting(
        "k3", help="KL estimator of the loss term (megatron_rl.algorithms.KL_ESTIMATORS)", registry=KL_ESTIMATORS
    )
    entropy_coef: float = setting(0.0, help="entropy bonus coefficient (loss -= entropy_coef * entropy)")
    rollout_correction: Literal["auto", "none", "tis", "mis", "icepop"] = setting(
        "auto",
        help="importance weights for the rollout-engine/trainer mismatch (and, in async mode, the behaviour "
        "policy's staleness: decoupled PPO): tis = truncate at cap, mis = drop above cap, icepop = drop outside "
        "[low, high]; auto = tis in async mode, none in sync mode (resolved when the config is loaded)",
    )
    rollout_correction_level: Literal["token", "sequence", "geometric"] = setting(
        "token", help="rollout-correction ratio per token, per sequence (product) or geometric mean"
    )
    rollout_correction_cap: float = setting(2.0, help="cap C of tis / mis", gt=0)
    rollout_correction_low: float = setting(0.5, help="icepop lower bound alpha", ge=0)
    rollout_correction_high: float = setting(5.0, help="icepop upper bound beta", ge=0)
    dynamic_sampling: bool = setting(
        False, help="DAPO dynamic sampling: drop groups whose rewards are all equal, regenerate until the batch is full"
    )
    max_dynamic_tries: int = setting(
        10, help="generation rounds per step dynamic sampling may use before training on what it has", ge=1
    )
    overlong_buffer: int = setting(
        0,
        help="DAPO soft overlong penalty L_cache in tokens: the penalty ramps from 0 at max_new_tokens - "
        "L_cache to -overlong_penalty_factor at max_new_tokens; 0 = off",
        ge=0,
    )
    overlong_penalty_factor: float = setting(1.0, help="size of the full overlong penalty", ge=0)
    overlong_filter: bool = setting(False, help="mask the loss of truncated responses (DAPO overlong filtering)")
    routing_replay: Literal["off", "R2", "R3"] = setting(
        "off",
        help="MoE routing replay: R2 = record routes in the old-policy pass and replay them in training; R3 = "
        "replay the rollout engine's routes in every training-side pass",
    )
    replay_check: Literal["every_step", "first_step", "off"] = setting(
        "every_step",
        help="routing replay: check at every router call that the replayed experts were used and each micro-batch's "
        "routes consumed exactly once (RouteReplayError otherwise) in every RL step, only in the first RL step of "
        "each start (alignment is a property of the code and layout, not of the step), or never",
    )
    first_update_check: Literal["first_step", "every_step"] = setting(
        "first_step",
        help="when the old-policy pass also scores the first update's mini-batch, so that actor/ppo_kl_first == 0 "
        "checks the scoring forward against the training forward: in the first RL step of each start, or in every "
        "step; on the other steps that update's own forward gives its old log-probs (the weights are still the old "
        "policy's), one scoring forward fewer per step. R2 and steps measuring routing agreement always score it",
    )
    replay_agreement_every: int = setting(
        1,
        help="routing replay: measure routing/agreement (replayed vs the current weights' own routes; one router "
        "matmul per MoE layer and pass) every this many RL steps; 0 = never",
        ge=0,
    )
    ppo_epochs: int = setting(
        1, help="passes over each rollout batch (later passes run the same mini-batches in a seeded order)", ge=1
    )
    distill: DistillConfig = setting(
        default_factory=DistillConfig, help="on-policy distillation from a teacher (per-token reverse KL)"
    )
    critic: CriticConfig = setting(default_factory=CriticConfig, help="the learned critic of algo.advantage=gae")
    mini_batches_per_step: int = setting(
        1,
        help="optimizer updates per pass: the rollout batch is split into this many mini-batches (updates per "
        "step = ppo_epochs * mini_batches_per_step)",
        ge=1,
    )


def check_critic(cfg: Any, errors: list[str], notes: list[str]) -> None:
    """Load-time checks of PPO with a critic (`algo.advantage: gae`, `algo.critic`, `algo.kl_in_reward`)."""
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
