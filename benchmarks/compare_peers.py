"""Check ``docs/algorithms.md`` against verl 0.9.1 and TRL 1.16.0: values and gradients on random inputs.

Every row runs one of our functions and the peer's own function on the same float64 inputs and reports the largest
absolute difference of the value and of the gradient with respect to the current log-probs. A row states what the
doc claims: ``agree`` (both differences <= TOL) or a documented difference (that quantity must differ by more than
TOL; a paired row then shows the stated reconciliation agrees). The script exits 1 when a claim fails.

verl is called through ``verl.trainer.ppo.core_algos`` and ``rollout_corr_helper``. TRL keeps its loss inside
``GRPOTrainer._compute_loss``, so that method runs unmodified on a trainer object built without ``__init__``
(no model, no tokenizer): its attributes come from a real ``GRPOConfig`` and a CPU ``Accelerator``, and its
log-prob method returns the given tensor instead of running a model. TRL's advantages are computed inline during
generation and are not compared here.

Neither peer is a project dependency. To run, install both into a throwaway environment::

    python -m venv --system-site-packages /tmp/peers
    /tmp/peers/bin/pip install --no-deps verl==0.9.1 trl==1.16.0
    /tmp/peers/bin/pip install omegaconf ray tensordict pandas codetiming accelerate datasets
    /tmp/peers/bin/python benchmarks/compare_peers.py

A peer that does not import is reported as skipped (exit 0).
"""

from __future__ import annotations

import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from megatron_rl.algorithms import aggregate, compute_advantages, kl_penalty, policy_loss, rollout_correction_weights

TOL = 1e-8
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
GSPO_CLIP_LOW, GSPO_CLIP_HIGH = 0.03, 0.04
MAX_LEN = 12  # padded response length = the generation cap L_max of the Dr. GRPO rows
# (our KL kind, verl's kind, whether they agree for |d| up to 25): verl's k3 is our low_var_kl.
KL_CASES = (("k1", "k1", True), ("k2", "k2", True), ("low_var_kl", "k3", True), ("low_var_kl", "low_var_kl", True),
            ("k3", "k3", False))  # fmt: skip
# (TRL loss_type, our agg, our agg_norm) that compute the same loss.
TRL_LOSS_TYPES = (("grpo", "seq-mean-token-mean", None), ("bnpo", "token-mean", None), ("dapo", "token-mean", None),
                  ("dr_grpo", "seq-mean-token-sum-norm", MAX_LEN))  # fmt: skip


@dataclass
class Row:
    item: str
    peer: str
    value_diff: float
    grad_diff: float | None
    value_agrees: bool = True  # what the doc claims
    grad_agrees: bool = True

    @property
    def ok(self) -> bool:
        grad_ok = self.grad_diff is None or (self.grad_diff <= TOL) == self.grad_agrees
        return (self.value_diff <= TOL) == self.value_agrees and grad_ok

    @property
    def claim(self) -> str:
        if self.value_agrees and self.grad_agrees:
            return "agree"
        return "differ: " + ", ".join(q for q, a in (("value", self.value_agrees), ("grad", self.grad_agrees)) if not a)


@dataclass
class Batch:
    logp: torch.Tensor
    old: torch.Tensor
    rollout: torch.Tensor
    ref: torch.Tensor
    adv_seq: torch.Tensor  # [B]
    adv_tok: torch.Tensor  # [B, T]
    mask: torch.Tensor  # float 0/1

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def nonempty(self) -> int:
        return int((self.mask.sum(-1) > 0).sum())


def make_batch(seed: int, empty_row: bool = False, rows: int = 8, gspo_scale: float = 1.0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (rows,), generator=gen)
    if empty_row:
        lengths[rows // 2] = 0
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).double()
    logp = -2 * torch.rand(rows, MAX_LEN, generator=gen, dtype=torch.float64) - 0.05
    old = logp + 0.3 * gspo_scale * torch.randn(rows, MAX_LEN, generator=gen, dtype=torch.float64)
    rollout = old + 0.4 * torch.randn(rows, MAX_LEN, generator=gen, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(rows, MAX_LEN, generator=gen, dtype=torch.float64)
    adv_seq = torch.randn(rows, generator=gen, dtype=torch.float64)
    adv_tok = torch.randn(rows, MAX_LEN, generator=gen, dtype=torch.float64)
    return Batch(logp, old, rollout, ref, adv_seq, adv_tok, mask)


def value_and_grad(fn: Callable[[torch.Tensor], torch.Tensor], logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logp.clone().requires_grad_(True)
    out = fn(leaf)
    (grad,) = torch.autograd.grad(out, leaf, allow_unused=True)
    return out.detach(), torch.zeros_like(logp) if grad is None else grad


def compare(item: str, peer: str, ours, theirs, logp, value_agrees=True, grad_agrees=True) -> Row:
    v1, g1 = value_and_grad(ours, logp)
    v2, g2 = value_and_grad(theirs, logp)
    return Row(item, peer, (v1 - v2).abs().max().item(), (g1 - g2).abs().max().item(), value_agrees, grad_agrees)


def ours_loss(name: str, batch: Batch, adv: torch.Tensor, agg: str = "token-mean", **options):
    """Our aggregated ``policy_loss`` as a function of the current log-probs."""
    return lambda lp: policy_loss(name, lp, batch.old, adv, batch.mask, agg=agg, **options)[0]


def compare_values(item: str, peer: str, ours, theirs, mask=None, value_agrees: bool = True) -> Row:
    """Values only (no gradient); with ``mask``, positions outside it are not compared."""
    diff = ours - theirs if mask is None else torch.where(mask.bool(), ours - theirs, 0.0)
    return Row(item, peer, diff.abs().max().item(), None, value_agrees=value_agrees)


# ---------------------------------------------------------------------------------------------------- verl


def verl_rows() -> list[Row]:
    from verl.trainer.ppo import core_algos as va
    from verl.trainer.ppo import rollout_corr_helper as vr
    from verl.workers.config import ActorConfig

    def actor(**kw) -> ActorConfig:
        return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, **kw)

    rows: list[Row] = []
    b, e = make_batch(0), make_batch(1, empty_row=True)

    # Aggregation (doc: Semantics, convention 8).
    for mode in AGG_MODES:
        loss = b.ref - b.old
        rows.append(
            compare_values(
                f"aggregate {mode}", "verl", aggregate(loss, b.mask, mode), va.agg_loss(loss, b.mask, mode), b.mask
            )
        )
        loss = e.ref - e.old
        ours, theirs = aggregate(loss, e.mask, mode), va.agg_loss(loss, e.mask, mode)
        row = compare_values(f"aggregate {mode}, one empty row", "verl", ours, theirs, e.mask)
        if mode == "seq-mean-token-sum-norm":
            row.value_agrees = False
            rows.append(row)
            rows.append(
                compare_values(
                    f"  ... ours x B/S ({e.rows}/{e.nonempty})", "verl", ours * e.rows / e.nonempty, theirs, e.mask
                )
            )
        else:
            rows.append(row)
    rows.append(
        compare_values(
            "aggregate seq-mean-token-sum-norm, norm=L_max",
            "verl",
            aggregate(b.ref, b.mask, "seq-mean-token-sum-norm", norm=32.0),
            va.agg_loss(b.ref, b.mask, "seq-mean-token-sum-norm", loss_scale_factor=32),
            b.mask,
        )
    )

    # PPO clip with verl's always-on dual clip (convention 3), TIS weights, each aggregation.
    weights = rollout_correction_weights(b.old, b.rollout, b.mask, mode="tis", cap=2.0)
    cfg = actor(clip_ratio=CLIP_LOW, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=3.0)
    clip = {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH}
    for mode in AGG_MODES:
        ours = ours_loss("ppo", b, b.adv_tok, mode, clip_c=3.0, rollout_weights=weights, **clip)

        def theirs(lp, mode=mode):
            return va.compute_policy_loss_vanilla(b.old, lp, b.adv_tok, b.mask, mode, cfg, weights)[0]

        rows.append(compare(f"ppo dual-clip c=3 + token TIS, {mode}", "verl", ours, theirs, b.logp))
    _, ours_m = policy_loss("ppo", b.logp, b.old, b.adv_tok, b.mask, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, clip_c=3.0)
    _, their_m = va.compute_policy_loss_vanilla(b.old, b.logp, b.adv_tok, b.mask, "token-mean", cfg)
    pairs = (
        ("clip_frac_low + clip_frac_high", ours_m["clip_frac_low"] + ours_m["clip_frac_high"], "pg_clipfrac"),
        ("clip_frac_dual", ours_m["clip_frac_dual"], "pg_clipfrac_lower"),
        ("ppo_kl", ours_m["ppo_kl"], "ppo_kl"),
    )
    for name, value, key in pairs:
        rows.append(Row(f"ppo metric {name} = verl {key}", "verl", abs(value.item() - their_m[f"actor/{key}"]), None))

    # GSPO: verl honours loss_agg_mode and uses the token form, so it is our gspo_token (conventions 4, 9, 16).
    g = make_batch(2, gspo_scale=0.1)
    g_weights = rollout_correction_weights(g.old, g.rollout, g.mask, mode="tis", cap=2.0)
    g_seq_weights = rollout_correction_weights(g.old, g.rollout, g.mask, level="geometric", mode="tis", cap=2.0)
    cfg = actor(clip_ratio=GSPO_CLIP_LOW, clip_ratio_low=GSPO_CLIP_LOW, clip_ratio_high=GSPO_CLIP_HIGH)

    def gspo_pair(name, adv, w, mode):
        def theirs(lp):
            full_adv = adv if adv.dim() == 2 else adv[:, None].expand_as(lp)
            return va.compute_policy_loss_gspo(g.old, lp, full_adv, g.mask, mode, cfg, w)[0]

        ours = ours_loss(name, g, adv, mode, clip_low=GSPO_CLIP_LOW, clip_high=GSPO_CLIP_HIGH, rollout_weights=w)
        return ours, theirs

    for mode in AGG_MODES:
        ours, theirs = gspo_pair("gspo_token", g.adv_tok, g_weights, mode)
        rows.append(compare(f"gspo_token, token A + token TIS, {mode}", "verl gspo", ours, theirs, g.logp))
    ours, theirs = gspo_pair("gspo", g.adv_seq, g_seq_weights, "seq-mean-token-mean")
    rows.append(compare("gspo, sequence A + geometric TIS", "verl gspo", ours, theirs, g.logp))
    ours, theirs = gspo_pair("gspo", g.adv_seq, g_weights, "seq-mean-token-mean")
    rows.append(compare("gspo, sequence A + token TIS", "verl gspo", ours, theirs, g.logp, grad_agrees=False))
    token_mean = va.compute_policy_loss_gspo(g.old, g.logp, g.adv_tok, g.mask, "token-mean", cfg)[0]
    seq_mean = va.compute_policy_loss_gspo(g.old, g.logp, g.adv_tok, g.mask, "seq-mean-token-mean", cfg)[0]
    item = "verl gspo token-mean vs its seq-mean-token-mean"
    rows.append(compare_values(item, "verl", token_mean, seq_mean, value_agrees=False))

    # SAPO: verl forces seq-mean-token-mean whatever loss_agg_mode says (convention 4).
    cfg = actor(tau_pos=1.0, tau_neg=1.05)
    ours = ours_loss("sapo", b, b.adv_tok, "seq-mean-token-mean", rollout_weights=weights)
    for mode in ("token-mean", "seq-mean-token-mean"):

        def theirs(lp, mode=mode):
            return va.compute_policy_loss_sapo(b.old, lp, b.adv_tok, b.mask, mode, cfg, weights)[0]

        rows.append(compare(f"sapo (ours seq-mean-token-mean), verl given {mode}", "verl", ours, theirs, b.logp))

    # CISPO (convention 6).
    cfg = actor(clip_ratio=CLIP_LOW, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
    rows.append(
        compare(
            "cispo + token TIS, token-mean",
            "verl",
            ours_loss("cispo", b, b.adv_tok, rollout_weights=weights, **clip),
            lambda lp: va.compute_policy_loss_cispo(b.old, lp, b.adv_tok, b.mask, "token-mean", cfg, weights)[0],
            b.logp,
        )
    )

    # KL estimators (convention 7); x spans |d| up to 25, so verl's result clamp at 10 is active somewhere.
    x = torch.linspace(-25, 25, 101, dtype=torch.float64)[None, :]
    zero = torch.zeros_like(x)
    for ours_kind, verl_kind, agrees in KL_CASES:
        rows.append(
            compare(
                f"kl {ours_kind} vs verl {verl_kind}, |d| <= 25",
                "verl",
                lambda lp, k=ours_kind: kl_penalty(lp, zero, k).sum(),
                lambda lp, k=verl_kind: va.kl_penalty(lp, zero, k).sum(),
                x,
                value_agrees=agrees,
                grad_agrees=agrees,
            )
        )
    small = torch.linspace(-2, 2, 101, dtype=torch.float64)[None, :]
    rows.append(
        compare(
            "kl k3 vs verl k3, |d| <= 2",
            "verl",
            lambda lp: kl_penalty(lp, zero, "k3").sum(),
            lambda lp: va.kl_penalty(lp, zero, "k3").sum(),
            small,
        )
    )

    # Advantages (conventions 1, 2).
    gen = torch.Generator().manual_seed(3)
    group, n_groups = 4, 5
    rewards = torch.rand(group * n_groups, generator=gen, dtype=torch.float64)
    index = np.repeat(np.arange(n_groups), group)
    token_rewards = torch.zeros(group * n_groups, MAX_LEN, dtype=torch.float64)
    token_rewards[:, 0] = rewards
    full_mask = torch.ones_like(token_rewards)
    one_mask = full_mask[:, :1]
    for name, options, fn in (
        ("grpo", {}, lambda: va.compute_grpo_outcome_advantage(token_rewards.clone(), full_mask, index)),
        (
            "grpo norm_by_std=False",
            {"norm_by_std": False},
            lambda: va.compute_grpo_outcome_advantage(
                token_rewards.clone(), full_mask, index, norm_adv_by_std_in_grpo=False
            ),
        ),
        (
            "dr_grpo",
            {},
            lambda: va.compute_grpo_outcome_advantage(
                token_rewards.clone(), full_mask, index, norm_adv_by_std_in_grpo=False
            ),
        ),
        ("rloo", {}, lambda: va.compute_rloo_outcome_advantage(token_rewards.clone(), full_mask, index)),
    ):
        ours = compute_advantages(name.split()[0], rewards, group, **options)
        rows.append(compare_values(f"advantages {name}", "verl", ours, fn()[0][:, 0]))
    # A group of one response: verl divides by std 1 around mean 0 (the raw reward), ours gives 0.
    single = va.compute_grpo_outcome_advantage(token_rewards[:3].clone(), full_mask[:3], np.arange(3))[0][:, 0]
    ours = compute_advantages("grpo", rewards[:3], 1)
    rows.append(compare_values("advantages grpo, groups of size 1: ours 0", "verl", ours, single, value_agrees=False))
    # REINFORCE++-baseline: verl whitens over tokens; with one token per response it whitens over responses,
    # and its eps sits inside the square root (rsqrt(var + 1e-8)) while ours is std + eps.
    theirs = va.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards[:, None].clone(), one_mask, index)[0]
    ours = compute_advantages("reinforce_pp", rewards, group, eps=0.0)
    item = "advantages reinforce_pp eps=0, 1-token responses"
    rows.append(compare_values(item, "verl", ours, theirs[:, 0], value_agrees=False))
    centered = compute_advantages("dr_grpo", rewards, group)
    moved_eps = centered / (centered.var() + 1e-8).sqrt()
    rows.append(compare_values("  ... with verl's eps inside the sqrt", "verl", moved_eps, theirs[:, 0]))
    lengths = torch.arange(group * n_groups)[:, None] % 7 + 1
    uneven_mask = (torch.arange(MAX_LEN)[None, :] < lengths).double()
    theirs = va.compute_reinforce_plus_plus_baseline_outcome_advantage(token_rewards.clone(), uneven_mask, index)[0]
    item = "advantages reinforce_pp, unequal lengths (token whitening)"
    rows.append(compare_values(item, "verl", ours, theirs[:, 0], value_agrees=False))

    # Rollout correction (convention 5): TIS at token and sequence level, IcePop.
    log_ratio = (b.old - b.rollout) * b.mask
    for level, threshold, mode, kw in (
        ("token", 2.0, "tis", {"cap": 2.0}),
        ("sequence", 2.0, "tis", {"cap": 2.0}),
        ("token", "0.5_5.0", "icepop", {"low": 0.5, "high": 5.0}),
    ):
        theirs, _ = vr.compute_rollout_correction_weights(log_ratio, b.mask, level, threshold)
        ours = rollout_correction_weights(b.old, b.rollout, b.mask, level=level, mode=mode, **kw)
        rows.append(compare_values(f"rollout weights {level} {mode}", "verl", ours, theirs, b.mask))
    return rows


# ---------------------------------------------------------------------------------------------------- TRL


def trl_loss_fn(loss_type: str, batch: Batch, adv: torch.Tensor, **config) -> Callable[[torch.Tensor], torch.Tensor]:
    """``GRPOTrainer._compute_loss`` with ``config`` as ``GRPOConfig`` fields, as a function of the log-probs."""
    from accelerate import Accelerator
    from trl import GRPOConfig, GRPOTrainer

    is_ratio = config.pop("importance_sampling_ratio", None)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        bf16=False,
        loss_type=loss_type,
        max_completion_length=MAX_LEN,
        **config,
    )
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    state = dict(
        args=args,
        loss_type=loss_type,
        beta=args.beta,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level,
        top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        max_completion_length=MAX_LEN,
        accelerator=Accelerator(cpu=True),
        model=torch.nn.Module(),
        current_gradient_accumulation_steps=1,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    trainer.__dict__.update(state)
    rows, length = batch.mask.shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, length, dtype=torch.long),
        "completion_mask": batch.mask,
        "advantages": adv,
        "old_per_token_logps": batch.old,
        "ref_per_token_logps": batch.ref,
        "num_items_in_batch": batch.mask.sum(),
        "importance_sampling_ratio": is_ratio,
    }

    def loss(logp: torch.Tensor) -> torch.Tensor:
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
        return trainer._compute_loss(trainer.model, inputs)

    return loss


def trl_rows() -> list[Row]:
    import trl  # noqa: F401

    rows: list[Row] = []
    b, e = make_batch(4), make_batch(5, empty_row=True)
    clip = {"epsilon": CLIP_LOW, "epsilon_high": CLIP_HIGH}
    our_clip = {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH}

    for trl_type, agg, norm in TRL_LOSS_TYPES:
        rows.append(
            compare(
                f"ppo clip, loss_type={trl_type} vs agg={agg}",
                "TRL",
                ours_loss("ppo", b, b.adv_seq, agg, agg_norm=norm, **our_clip),
                trl_loss_fn(trl_type, b, b.adv_seq, beta=0.0, **clip),
                b.logp,
            )
        )
    # Empty rows: TRL's grpo divides by all rows B, ours (and verl) by the S non-empty ones.
    ours_fn = ours_loss("ppo", e, e.adv_seq, "seq-mean-token-mean", **our_clip)
    trl_fn = trl_loss_fn("grpo", e, e.adv_seq, beta=0.0, **clip)
    rows.append(compare("grpo, one empty row", "TRL", ours_fn, trl_fn, e.logp, value_agrees=False, grad_agrees=False))
    rows.append(
        compare(
            f"  ... ours x S/B ({e.nonempty}/{e.rows})",
            "TRL",
            lambda lp: ours_fn(lp) * e.nonempty / e.rows,
            trl_fn,
            e.logp,
        )
    )

    # KL: ours adds beta * aggregate(k3); TRL multiplies k3 by the ratio unless use_bias_correction_kl=False.
    beta = 0.04

    def ours_kl(lp):
        pg = ours_loss("ppo", b, b.adv_seq, "seq-mean-token-mean", **our_clip)(lp)
        return pg + beta * aggregate(kl_penalty(lp, b.ref, "k3", b.mask), b.mask, "seq-mean-token-mean")

    rows.append(
        compare(
            "grpo + 0.04 k3, use_bias_correction_kl=False",
            "TRL",
            ours_kl,
            trl_loss_fn("grpo", b, b.adv_seq, beta=beta, use_bias_correction_kl=False, **clip),
            b.logp,
        )
    )
    rows.append(
        compare(
            "grpo + 0.04 k3, use_bias_correction_kl=True (default)",
            "TRL",
            ours_kl,
            trl_loss_fn("grpo", b, b.adv_seq, beta=beta, **clip),
            b.logp,
            value_agrees=False,
            grad_agrees=False,
        )
    )
    on_policy = Batch(b.logp, b.logp, b.rollout, b.ref, b.adv_seq, b.adv_tok, b.mask)
    rows.append(
        compare(
            "  ... on-policy (ratio = 1): value agrees, gradient differs",
            "TRL",
            lambda lp: (
                ours_loss("ppo", on_policy, b.adv_seq, "seq-mean-token-mean")(lp)
                + beta * aggregate(kl_penalty(lp, b.ref, "k3", b.mask), b.mask, "seq-mean-token-mean")
            ),
            trl_loss_fn("grpo", on_policy, b.adv_seq, beta=beta),
            b.logp,
            grad_agrees=False,
        )
    )

    # GSPO = importance_sampling_level="sequence"; token-level vLLM IS weights give the mean-weight gradient.
    g = make_batch(6, gspo_scale=0.1)
    g_clip = {"epsilon": GSPO_CLIP_LOW, "epsilon_high": GSPO_CLIP_HIGH}
    our_gspo_clip = {"clip_low": GSPO_CLIP_LOW, "clip_high": GSPO_CLIP_HIGH}
    tis = rollout_correction_weights(g.old, g.rollout, g.mask, mode="tis", cap=2.0)
    for name, agrees in (("gspo", True), ("gspo_token", False)):
        rows.append(
            compare(
                f"{name} + token TIS vs TRL sequence level + token_truncate",
                "TRL",
                ours_loss(name, g, g.adv_seq, "seq-mean-token-mean", rollout_weights=tis, **our_gspo_clip),
                trl_loss_fn(
                    "grpo",
                    g,
                    g.adv_seq,
                    beta=0.0,
                    importance_sampling_level="sequence",
                    importance_sampling_ratio=tis,
                    **g_clip,
                ),
                g.logp,
                grad_agrees=agrees,
            )
        )

    # SAPO and CISPO (TRL's CISPO cap is absolute: clip_high = eps_max - 1, clip_low >= 1).
    rows.append(
        compare(
            "sapo, seq-mean-token-mean",
            "TRL",
            ours_loss("sapo", b, b.adv_seq, "seq-mean-token-mean"),
            trl_loss_fn("sapo", b, b.adv_seq, beta=0.0),
            b.logp,
        )
    )
    rows.append(
        compare(
            "cispo clip_low=1, clip_high=eps_max-1, token-mean",
            "TRL",
            ours_loss("cispo", b, b.adv_seq, "token-mean", clip_low=1.0, clip_high=0.28),
            trl_loss_fn("cispo", b, b.adv_seq, beta=0.0, epsilon_high=1.28),
            b.logp,
        )
    )

    from trl.trainer.utils import nanstd

    x = torch.rand(16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    rows.append(compare_values("group std: ours N-1 = TRL nanstd", "TRL", x.std(), nanstd(x)))
    return rows


# ---------------------------------------------------------------------------------------------------- main


def main() -> int:
    torch.set_default_dtype(torch.float64)
    rows: list[Row] = []
    for package, checked, build in (("verl", "0.9.1", verl_rows), ("trl", "1.16.0", trl_rows)):
        try:
            rows += build()
            print(f"{package} {metadata.version(package)} (this page was checked against {checked})")
        except ImportError as err:
            print(f"{package}: skipped ({err})")
    if not rows:
        return 0
    print(f"{'item':<72} {'peer':<10} {'max|dvalue|':>11} {'max|dgrad|':>11}  claim / result")
    for row in rows:
        grad = "-" if row.grad_diff is None else f"{row.grad_diff:.2e}"
        verdict = "ok" if row.ok else "CLAIM FAILS"
        print(f"{row.item:<72} {row.peer:<10} {row.value_diff:>11.2e} {grad:>11}  {row.claim} / {verdict}")
    agreeing = [r for r in rows if r.value_agrees and r.grad_agrees]
    worst = max(max(r.value_diff, r.grad_diff or 0.0) for r in agreeing)
    failed = [r for r in rows if not r.ok]
    print(
        f"{len(rows)} rows, {len(failed)} failed claims; largest difference where the doc claims agreement: "
        f"{worst:.2e} (TOL {TOL:.0e})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
