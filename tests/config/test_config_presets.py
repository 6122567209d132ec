"""Presets equal the published algorithms (docs/algorithms.md)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from megatron_rl.config import PRESETS, AlgoConfig, OfMaxNewTokens, load_config, preset_values
from megatron_rl.config.algo import CriticConfig, PresetName
from megatron_rl.config.presets import CORE_KEYS

MAX_NEW = 1000
BASE = ["model.hf_path=/models/m", f"rollout.sampling.max_new_tokens={MAX_NEW}"]

# The documented values, written out independently of presets.py.
DOCUMENTED = {
    "grpo": dict(  # DeepSeekMath eq. 3-4, beta = 0.04, k3 in the loss
        loss="ppo",
        clip_low=0.2,
        clip_high=0.2,
        agg="seq-mean-token-mean",
        advantage="grpo",
        norm_adv_by_std=True,
        kl_coef=0.04,
        kl_estimator="k3",
        dynamic_sampling=False,
        overlong_buffer=0,
    ),
    "dapo": dict(  # DAPO eq. 8-13: clip-higher, token-mean, no KL, dynamic sampling, soft overlong penalty
        loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        advantage="grpo",
        norm_adv_by_std=True,
        kl_coef=0.0,
        dynamic_sampling=True,
        overlong_buffer=MAX_NEW // 5,
        overlong_penalty_factor=1.0,
        overlong_filter=False,
    ),
    "gspo": dict(  # GSPO eq. 5-7
        loss="gspo",
        clip_low=3e-4,
        clip_high=4e-4,
        agg="seq-mean-token-mean",
        advantage="grpo",
        kl_coef=0.0,
        dynamic_sampling=False,
        overlong_buffer=0,
    ),
    "sapo": dict(  # SAPO: tau_pos 1.0, tau_neg 1.05
        loss="sapo",
        tau_pos=1.0,
        tau_neg=1.05,
        agg="seq-mean-token-mean",
        advantage="grpo",
        kl_coef=0.0,
    ),
    "dr_grpo": dict(  # Dr. GRPO: no std, sum over B * L_max, no KL
        loss="ppo",
        clip_low=0.2,
        clip_high=0.2,
        agg="seq-mean-token-sum-norm",
        agg_norm=float(MAX_NEW),
        advantage="dr_grpo",
        norm_adv_by_std=False,
        kl_coef=0.0,
    ),
    "cispo": dict(  # MiniMax-M1: no lower bound, eps_high 4 (cap 5), token-mean, DAPO shaping, no KL
        loss="cispo",
        clip_low=1.0,
        clip_high=4.0,
        agg="token-mean",
        advantage="grpo",
        kl_coef=0.0,
        dynamic_sampling=True,
        overlong_buffer=MAX_NEW // 5,
    ),
    "ppo": dict(  # PPO with a critic as verl runs it: GAE gamma = lambda = 1, value clip 0.5, whitened, no KL
        loss="ppo",
        clip_low=0.2,
        clip_high=0.2,
        agg="token-mean",
        advantage="gae",
        kl_coef=0.0,
        critic=CriticConfig(gamma=1.0, lam=1.0, value_clip=0.5, whiten=True),
    ),
    "vapo": dict(  # VAPO: lambda_critic 1, length-adaptive lambda_actor (alpha 0.05), 50 value pre-training steps
        loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        advantage="gae",
        kl_coef=0.0,
        critic=CriticConfig(gamma=1.0, lam=1.0, lam_actor_alpha=0.05, value_clip=0.5, whiten=True, warmup_steps=50),
    ),
}


def test_every_named_preset_is_documented():
    assert set(PRESETS) == {"none", *DOCUMENTED}
    assert set(PRESETS) == set(typing.get_args(PresetName))  # algo.preset accepts exactly these
    assert PRESETS["none"] == {}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_preset_equals_documented_values(name: str):
    algo = load_config(None, [*BASE, f"algo.preset={name}", "trainer.micro_batch_tokens=4096"]).algo
    for key, value in DOCUMENTED[name].items():
        assert getattr(algo, key) == value, (name, key)
    assert algo.clip_c is None and algo.preset == name


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_preset_sets_every_core_key_with_valid_names(name: str):
    values = PRESETS[name]
    assert set(CORE_KEYS) <= set(values), set(CORE_KEYS) - set(values)
    assert set(values) <= {f.name for f in dataclasses.fields(AlgoConfig)}
    assert values["loss"] in POLICY_LOSSES and values["agg"] in AGGREGATIONS
    assert values["advantage"] in (*ADVANTAGE_ESTIMATORS.names(), "gae") and values["kl_estimator"] in KL_ESTIMATORS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_with_defaults(name: str):
    cfg = load_config(None, ["model.hf_path=/models/m", f"algo.preset={name}"])
    assert cfg.algo.preset == name
    resolved = preset_values(name, cfg.rollout.sampling.max_new_tokens)
    for key, value in resolved.items():  # a nested section (algo.critic) by the keys the preset sets
        got = getattr(cfg.algo, key)
        assert {k: getattr(got, k) for k in value} == value if isinstance(value, dict) else got == value, key


def test_dapo_overlong_buffer_matches_paper_at_paper_length():
    assert preset_values("dapo", 20480)["overlong_buffer"] == 4096


def test_derived_values_resolve():
    assert isinstance(PRESETS["dr_grpo"]["agg_norm"], OfMaxNewTokens)
    assert preset_values("dr_grpo", 3000)["agg_norm"] == 3000
    assert str(OfMaxNewTokens(0.2)) == "0.2 * rollout.sampling.max_new_tokens"
    assert preset_values("dapo", 3)["overlong_buffer"] == 1


def test_any_part_of_a_preset_can_be_overridden():
    algo = load_config(None, [*BASE, "algo.preset=dapo", "algo.dynamic_sampling=false", "algo.loss=cispo"]).algo
    assert (algo.loss, algo.dynamic_sampling, algo.clip_high) == ("cispo", False, 0.28)
