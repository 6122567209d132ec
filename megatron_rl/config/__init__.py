"""Configuration of a training run: one typed tree with help text, YAML files, dotted overrides, presets.

    cfg = load_config("examples/tiny_moe_gspo.yaml", ["algo.loss=sapo", "rollout.n_samples=8"])
    print(format_config(cfg)); dump_yaml(cfg, out / "config.yaml")

Precedence: defaults < ``algo.preset`` < YAML file < overrides. Invalid keys, values and
combinations raise ConfigError (a ValueError) naming the key; `config_help()` lists every key.
"""

from megatron_rl.config.coercion import to_dict
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.help_text import config_help
from megatron_rl.config.loader import dump_yaml, format_config, from_dict, load_config, parse_override
from megatron_rl.config.presets import PRESETS, OfMaxNewTokens, preset_values
from megatron_rl.config.schema import (
    AlgoConfig,
    DataConfig,
    EvalSet,
    LoggingConfig,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    SGLangConfig,
    TrainerConfig,
    WarmupConfig,
)
from megatron_rl.config.validation import check_input_paths, validate

__all__ = [
    "PRESETS",
    "AlgoConfig",
    "ConfigError",
    "DataConfig",
    "EvalSet",
    "LoggingConfig",
    "ModelConfig",
    "OfMaxNewTokens",
    "RLConfig",
    "RolloutConfig",
    "SGLangConfig",
    "TrainerConfig",
    "WarmupConfig",
    "check_input_paths",
    "config_help",
    "dump_yaml",
    "format_config",
    "from_dict",
    "load_config",
    "parse_override",
    "preset_values",
    "to_dict",
    "validate",
]
