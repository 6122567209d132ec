"""The tree itself: help text everywhere, help output, cheap import, literals in step with the math."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from megatron_rl.algorithms import rollout_correction
from megatron_rl.config import RLConfig, config_help
from megatron_rl.config.coercion import field_specs, is_section, walk_fields
from megatron_rl.config.sampling import SamplingParams
from megatron_rl.config.schema import AlgoConfig, ModelConfig
from megatron_rl.megatron_backend.actor.megatron_actor import OptimizerOptions
from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
from megatron_rl.parallel_layout import ParallelLayout

REPO = Path(__file__).resolve().parents[2]
ALL_KEYS = [key for key, _ in walk_fields(RLConfig)]


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_field_has_help(key: str):
    spec = dict(walk_fields(RLConfig))[key]
    assert isinstance(spec.help, str) and len(spec.help.strip()) > 5, key


def test_tree_has_the_sections_and_reuses_the_backend_dataclasses():
    top = field_specs(RLConfig)
    assert list(top) == [
        "model", "parallel", "optimizer", "algo", "rollout", "data", "warmup", "trainer", "logging", "plugins",
    ]  # fmt: skip
    assert top["parallel"].type is ParallelLayout and top["optimizer"].type is OptimizerOptions
    assert field_specs(ModelConfig)["options"].type is ModelOptions
    assert dict(walk_fields(RLConfig))["rollout.sampling"].type is SamplingParams
    assert len(ALL_KEYS) > 100


def test_every_leaf_type_is_supported():
    """Each leaf annotation is one the coercion understands (no silent isinstance fallback)."""
    simple = {bool, int, float, str, type(None)}

    def supported(tp: object) -> bool:
        origin = typing.get_origin(tp)
        if tp in simple:
            return True
        if origin is typing.Literal:
            return True
        if origin is typing.Union or isinstance(tp, types.UnionType):
            return all(supported(a) for a in typing.get_args(tp))
        if origin is tuple:
            return all(supported(a) for a in typing.get_args(tp) if a is not Ellipsis)
        if origin is dict:  # a plug-in's keyword options (rollout.env_options)
            return typing.get_args(tp)[0] is str
        return is_section(tp)  # a list of sections (data.train, data.reward): each built as its dataclass

    for key, spec in walk_fields(RLConfig):
        assert is_section(spec.type) or supported(spec.type), (key, spec.type)


def test_config_help_lists_every_key_with_default_and_help():
    text = config_help()
    for key, spec in walk_fields(RLConfig):
        if is_section(spec.type):
            assert f"[{key}]" in text
        else:
            assert f"{key}: " in text and spec.help in text, key
    assert "model.hf_path: string; required" in text
    assert "algo.loss: one of cispo, gspo, gspo_token, ppo, sapo; default ppo" in text
    assert "algo.routing_replay: one of 'off', 'R2', 'R3'; default off" in text
    assert "dr_grpo: loss=ppo" in text and "agg_norm=(1 * rollout.sampling.max_new_tokens)" in text


def test_rollout_correction_literals_match_the_math():
    hints = typing.get_type_hints(AlgoConfig)
    assert typing.get_args(hints["rollout_correction"]) == ("auto", "none", *rollout_correction.MODES)
    assert typing.get_args(hints["rollout_correction_level"]) == rollout_correction.LEVELS


def test_import_is_cheap():
    """Importing the config must not pull Megatron-Core, Transformer Engine or SGLang."""
    check = (
        "import sys, megatron_rl.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'sglang', 'transformer_engine'))\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_free_form_options_take_a_mapping_and_refuse_anything_else():
    from megatron_rl.config.coercion import coerce
    from megatron_rl.config.errors import ConfigError

    assert coerce({"tools": ["calculator"]}, dict[str, typing.Any], "rollout.env_options") == {"tools": ["calculator"]}
    for bad in (["calculator"], "tools", {1: "x"}):
        with pytest.raises(ConfigError, match="rollout.env_options=.*expected a mapping of option names"):
            coerce(bad, dict[str, typing.Any], "rollout.env_options")
