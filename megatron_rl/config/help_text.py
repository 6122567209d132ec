"""`config_help()`: every key of the config tree with its type, default and help (``--help-config``)."""

from __future__ import annotations

from typing import Any

from megatron_rl.config.coercion import describe_type, is_section, walk_fields
from megatron_rl.config.presets import PRESETS, OfMaxNewTokens
from megatron_rl.config.schema import RLConfig


def format_value(value: Any) -> str:
    """A value as it would be written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value else "''"
    return str(value)


def _preset_value(value: Any) -> str:
    return f"({value})" if isinstance(value, OfMaxNewTokens) else format_value(value)


def config_help() -> str:
    """Every key: dotted name, type, default, help; then the algorithm presets."""
    lines = [
        "megatron_rl configuration. Set keys in a YAML file (one mapping per section) or on the command line",
        "as section.key=value (YAML syntax: 8, 0.5, true, null, [1, 2]); command line > YAML > algo.preset > default.",
        "",
    ]
    for key, spec in walk_fields(RLConfig):
        depth = key.count(".")
        indent = "  " * depth
        if is_section(spec.type):
            lines.append(f"{indent}[{key}]  {spec.help}")
            continue
        registry = spec.field.metadata.get("registry")
        kind = f"one of {', '.join(registry.names())}" if registry is not None else describe_type(spec.type)
        default = "required" if spec.required else f"default {format_value(spec.default())}"
        lines.append(f"{indent}{key}: {kind}; {default}")
        lines.append(f"{indent}    {spec.help}")
    lines += ["", "Algorithm presets (algo.preset=NAME sets these algo keys; explicit keys win):"]
    for name, values in PRESETS.items():
        if values:
            settings = " ".join(f"{k}={_preset_value(v)}" for k, v in values.items())
            lines.append(f"  {name}: {settings}")
    return "\n".join(lines) + "\n"
