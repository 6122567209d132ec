"""Loading configs: examples, defaults, overrides of every type, precedence, round trips, printing."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import (
    ConfigError,
    RLConfig,
    dump_yaml,
    format_config,
    from_dict,
    load_config,
    parse_override,
    to_dict,
)
from megatron_rl.config.sampling import SamplingParams
from megatron_rl.config.schema import LoggingConfig
from megatron_rl.parallel_layout import ParallelLayout

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
BASE = ["model.hf_path=/models/m"]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"tiny_moe_gspo.yaml", "tiny_moe_grpo_r2.yaml", "qwen3_30b_a3b_gspo_8xh100.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_and_round_trips(path: Path, tmp_path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, RLConfig)
    assert from_dict(to_dict(cfg)) == cfg
    assert load_config(dump_yaml(cfg, tmp_path / "config.yaml")) == cfg


def test_tiny_gspo_example_is_the_cpu_demo():
    cfg = load_config(REPO / "examples/tiny_moe_gspo.yaml")
    assert cfg.model.hf_path == "runs/tiny_moe/model" and cfg.model.build_tiny_if_missing
    assert cfg.model.tokenizer_path == "runs/tiny_moe/model"
    assert cfg.algo.preset == "gspo" and cfg.algo.loss == "gspo" and cfg.algo.clip_high == 4e-4
    assert cfg.rollout.engine == "local" and cfg.data.train == "synthetic"
    assert cfg.model.options.layer_spec == "local" and cfg.parallel == ParallelLayout()


def test_grpo_r2_example():
    cfg = load_config(REPO / "examples/tiny_moe_grpo_r2.yaml")
    assert (cfg.algo.preset, cfg.algo.loss, cfg.algo.routing_replay, cfg.algo.kl_coef) == ("grpo", "ppo", "R2", 0.04)


def test_qwen_example_layout():
    cfg = load_config(REPO / "examples/qwen3_30b_a3b_gspo_8xh100.yaml")
    assert cfg.parallel.resolve(8).ep == 8 and cfg.parallel.resolve(8).expert_dp == 1
    assert cfg.rollout.engine == "sglang" and cfg.rollout.sglang.tp_size == 8
    assert cfg.algo.loss == "gspo" and cfg.model.options.dtype == "bf16"


def test_no_file_gives_defaults():
    cfg = load_config(None, BASE)
    assert cfg.algo.preset == "none" and cfg.algo.loss == "ppo" and cfg.rollout.sampling == SamplingParams()
    assert cfg.model.tokenizer_path == "/models/m"


def test_empty_file_is_defaults(tmp_path: Path):
    assert load_config(write(tmp_path, ""), BASE) == load_config(None, BASE)


@pytest.mark.parametrize(
    ("override", "attr", "expected"),
    [
        ("rollout.n_samples=4", ("rollout", "n_samples"), 4),  # int
        ("optimizer.lr=3e-6", ("optimizer", "lr"), 3e-6),  # float written YAML-1.2 style
        ("optimizer.lr=1", ("optimizer", "lr"), 1.0),  # int accepted for float
        ("algo.overlong_filter=true", ("algo", "overlong_filter"), True),  # bool
        ("rollout.sglang.router=false", ("rollout", "sglang", "router"), False),
        ("data.train=/data/x.jsonl", ("data", "train"), "/data/x.jsonl"),  # str
        ("logging.wandb_run_name=007", ("logging", "wandb_run_name"), "007"),  # str kept as typed
        ("logging.wandb_run_name=true", ("logging", "wandb_run_name"), "true"),
        ("logging.wandb_run_name=null", ("logging", "wandb_run_name"), None),  # Optional -> None
        ("algo.clip_c=3", ("algo", "clip_c"), 3.0),  # Optional[float]
        ("algo.routing_replay=off", ("algo", "routing_replay"), "off"),  # Literal; 'off' is not a bool
        ("algo.routing_replay=R3", ("algo", "routing_replay"), "R3"),
        ("parallel.vpp=null", ("parallel", "vpp"), None),
        ("rollout.sampling.stop_token_ids=[1, 2]", ("rollout", "sampling", "stop_token_ids"), (1, 2)),  # tuple
        ("rollout.sampling.stop_token_ids=7", ("rollout", "sampling", "stop_token_ids"), (7,)),
        ("rollout.sampling.stop_token_ids=[]", ("rollout", "sampling", "stop_token_ids"), ()),
        ("rollout.sglang.urls=[http://a:30000, http://b:30000]", ("rollout", "sglang", "urls"), None),
        ("--rollout.n_samples=2", ("rollout", "n_samples"), 2),  # leading -- tolerated
        ("rollout.sampling.seed=0o17", ("rollout", "sampling", "seed"), 15),
        ("trainer.seed=010", ("trainer", "seed"), 10),  # YAML 1.2: not octal
    ],
)
def test_override_types(override: str, attr: tuple[str, ...], expected: object):
    overrides = [*BASE, override]
    if "urls" in override:
        overrides += ["rollout.engine=sglang", "trainer.colocate=false", "rollout.weight_sync=distributed"]
        expected = ("http://a:30000", "http://b:30000")
    if "R3" in override:
        overrides.append("model.options.routing_replay=true")
    value = load_config(None, overrides)
    for name in attr:
        value = getattr(value, name)
    assert value == expected and type(value) is type(expected)


def test_override_float_infinity():
    cfg = load_config(None, [*BASE, "algo.preset=cispo", "algo.clip_low=.inf"])
    assert math.isinf(cfg.algo.clip_low)


def test_override_whole_section_as_mapping():
    cfg = load_config(None, [*BASE, "rollout.sampling={temperature: 0.7, top_p: 0.9}"])
    assert (cfg.rollout.sampling.temperature, cfg.rollout.sampling.top_p) == (0.7, 0.9)
    assert cfg.rollout.sampling.max_new_tokens == SamplingParams().max_new_tokens


def test_parse_override_returns_path_and_typed_value():
    assert parse_override("algo.loss=gspo") == (["algo", "loss"], "gspo")
    assert parse_override("rollout.sampling.temperature=0") == (["rollout", "sampling", "temperature"], 0.0)
    assert parse_override("model.hf_path = a=b") == (["model", "hf_path"], "a=b")


def test_precedence_default_preset_yaml_cli(tmp_path: Path):
    path = write(tmp_path, "model: {hf_path: m}\nalgo:\n  preset: dapo\n  clip_high: 0.3\n  kl_coef: 0.01\n")
    cfg = load_config(path, ["algo.kl_coef=0.02"])
    assert cfg.algo.clip_low == 0.2  # preset (= default here)
    assert cfg.algo.agg == "token-mean"  # preset over default
    assert cfg.algo.clip_high == 0.3  # YAML over preset
    assert cfg.algo.kl_coef == 0.02  # CLI over YAML over preset
    assert cfg.algo.max_dynamic_tries == 10  # default, untouched by the preset


def test_yaml_key_wins_over_cli_preset(tmp_path: Path):
    """The preset is applied first even when chosen on the command line: explicit YAML keys still win."""
    path = write(tmp_path, "model: {hf_path: m}\nalgo: {clip_high: 0.5}\n")
    cfg = load_config(path, ["algo.preset=gspo"])
    assert cfg.algo.loss == "gspo" and cfg.algo.clip_low == 3e-4 and cfg.algo.clip_high == 0.5


def test_cli_preset_replaces_yaml_preset(tmp_path: Path):
    path = write(tmp_path, "model: {hf_path: m}\nalgo: {preset: grpo}\n")
    cfg = load_config(path, ["algo.preset=sapo"])
    assert cfg.algo.loss == "sapo" and cfg.algo.kl_coef == 0.0


def test_explicit_value_equal_to_default_still_wins_over_preset(tmp_path: Path):
    path = write(tmp_path, "model: {hf_path: m}\nalgo: {preset: grpo, kl_coef: 0.0}\n")
    assert load_config(path).algo.kl_coef == 0.0


def test_preset_none_keeps_defaults():
    cfg = load_config(None, [*BASE, "algo.preset=none"])
    assert cfg.algo == load_config(None, BASE).algo


def test_max_new_tokens_derived_preset_values_follow_final_value(tmp_path: Path):
    path = write(tmp_path, "model: {hf_path: m}\nalgo: {preset: dr_grpo}\nrollout: {sampling: {max_new_tokens: 100}}\n")
    assert load_config(path).algo.agg_norm == 100.0
    assert load_config(path, ["rollout.sampling.max_new_tokens=300"]).algo.agg_norm == 300.0
    assert load_config(path, ["algo.agg_norm=7"]).algo.agg_norm == 7.0
    dapo = load_config(
        None, [*BASE, "algo.preset=dapo", "rollout.sampling.max_new_tokens=20480", "trainer.micro_batch_tokens=32768"]
    )
    assert dapo.algo.overlong_buffer == 4096


def test_tokenizer_path_explicit_is_kept():
    cfg = load_config(None, [*BASE, "model.tokenizer_path=/tok"])
    assert cfg.model.tokenizer_path == "/tok"


def test_round_trip_exact_with_every_kind_of_value(tmp_path: Path):
    cfg = load_config(
        None,
        [
            *BASE,
            "algo.preset=dr_grpo",
            "algo.clip_c=3.0",
            "optimizer.adam_eps=1e-15",
            "optimizer.lr=.inf",
            "rollout.sampling.stop_token_ids=[0, 2]",
            "logging.wandb_run_name=1e-5",  # a string that looks like a number
            "data.train=off",  # a string that YAML 1.1 reads as a bool
            "data.prompt_key=0o7",  # a string that YAML 1.2 reads as an int
            "parallel.tp=2",
            "parallel.sp=true",
        ],
    )
    assert cfg.logging.wandb_run_name == "1e-5" and cfg.data.train == "off" and cfg.data.prompt_key == "0o7"
    assert from_dict(to_dict(cfg)) == cfg
    saved = dump_yaml(cfg, tmp_path / "sub" / "config.yaml")
    assert load_config(saved) == cfg
    assert from_dict(yaml.safe_load(saved.read_text())) == cfg  # plain YAML 1.1 readers agree


def test_to_dict_is_plain_yaml_data():
    data = to_dict(load_config(None, [*BASE, "rollout.sampling.stop_token_ids=[3]"]))
    assert data["rollout"]["sampling"]["stop_token_ids"] == [3]
    assert list(data) == [
        "model", "parallel", "optimizer", "algo", "rollout", "data", "warmup", "trainer", "logging", "plugins",
    ]  # fmt: skip
    yaml.safe_dump(data)  # only plain types


def test_format_config_is_yaml_of_the_config():
    cfg = load_config(REPO / "examples/tiny_moe_gspo.yaml")
    text = format_config(cfg)
    assert "preset: gspo" in text and "hf_path: runs/tiny_moe/model" in text
    assert from_dict(yaml.safe_load(text)) == cfg


def test_dump_yaml_writes_header(tmp_path: Path):
    path = dump_yaml(load_config(None, BASE), tmp_path / "config.yaml")
    assert path.read_text().startswith("# megatron_rl config, resolved")


def test_notes_are_logged(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="megatron_rl.config"):
        load_config(None, [*BASE, "algo.preset=grpo"])
    assert any("reference model" in r.getMessage() for r in caplog.records)


def test_wandb_mode_auto():
    auto = LoggingConfig()
    assert auto.resolved_wandb_mode({}) == "offline"
    assert auto.resolved_wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert LoggingConfig(wandb_mode="online").resolved_wandb_mode({}) == "online"
    assert LoggingConfig(wandb=False).resolved_wandb_mode({"WANDB_API_KEY": "k"}) == "disabled"


def test_configs_are_frozen():
    cfg = load_config(None, BASE)
    with pytest.raises(AttributeError):
        cfg.algo.loss = "gspo"  # type: ignore[misc]


def test_overrides_as_one_string_is_an_error():
    with pytest.raises(ConfigError, match="list of 'key=value'"):
        load_config(None, "algo.loss=gspo")  # type: ignore[arg-type]
