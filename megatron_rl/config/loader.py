"""Load a run's config: defaults < ``algo.preset`` < YAML file < ``key=value`` overrides, then validate.

YAML (files and override values) is read with YAML 1.2 core-schema scalars: only ``true``/``false``
are booleans (``off``, ``yes``, ``no`` stay strings, so ``algo.routing_replay=off`` works), ``1e-5`` is a
number, ``null``/``~`` is None, and ``010`` is ten. The resolved config is written the same way
(`dump_yaml`), quoting any string that a YAML 1.1 or 1.2 reader would take for something else, so
``load_config(dumped)`` gives back the same config. The ``plugins`` modules (next to the config file or in the working
directory) are imported first, so the rewards, environments and tools they register can be named.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.coercion import _plain, accepts_str, build, coerce_field, coerce_tree, section_of, to_dict
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.presets import PRESETS, preset_values
from megatron_rl.config.sampling import SamplingParams
from megatron_rl.config.schema import AlgoConfig, RLConfig
from megatron_rl.config.validation import validate

log = logging.getLogger(__name__)

# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution).
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_12 = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_TAG + "bool", _TAG + "int", _TAG + "float", _TAG + "timestamp"}


def _add_12_resolvers(cls: type[yaml.SafeLoader] | type[yaml.SafeDumper]) -> None:
    cls.add_implicit_resolver(_TAG + "bool", _BOOL_12, list("tTfF"))
    cls.add_implicit_resolver(_TAG + "int", _INT_12, list("-+0123456789"))
    cls.add_implicit_resolver(_TAG + "float", _FLOAT_12, list("-+.0123456789"))


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars instead of YAML 1.1's."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in _SCALAR_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 16) if text.startswith("0x") else int(text)


_add_12_resolvers(_Loader)
_Loader.add_constructor(_TAG + "int", _construct_int)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that also quotes strings YAML 1.2 would read as bool/int/float (it already does for 1.1)."""


_add_12_resolvers(_Dumper)


def parse_yaml(text: str) -> Any:
    """A YAML document (or one override value) with YAML 1.2 scalars."""
    return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in YAML file ``path`` (empty file -> {}); ConfigError if missing, malformed or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of sections (model:, algo:, ...), got {type(data).__name__}")
    return dict(data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` as (key path, value checked against the field's type); ConfigError says why not."""
    key, sep, raw = text.partition("=")
    key = key.strip().removeprefix("--")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not key=value, e.g. algo.loss=gspo or rollout.n_samples=8")
    path = key.split(".")
    _, spec = section_of(RLConfig, path)
    try:
        value = parse_yaml(raw) if raw.strip() else raw.strip()
    except yaml.YAMLError:
        value = raw
    if isinstance(value, bool | int | float) and accepts_str(spec.type):
        value = raw.strip()  # a string field keeps the text as typed: wandb_run_name=007
    return path, coerce_field(value, spec, key)


def _merge(base: dict[str, Any], update: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``base`` updated recursively with ``update`` (mappings merge, anything else replaces). An update keyed by
    list indices (an override ``rollout.side_models.0.urls=...``) merges into those items of the list."""
    out = dict(base)
    for name, value in update.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and isinstance(out.get(name), Mapping):
            out[name] = _merge(out[name], value, key + ".")
        elif isinstance(value, Mapping) and value and all(str(k).isdigit() for k in value):
            items = list(out.get(name) or ())
            for index, item in value.items():
                if int(index) >= len(items) or not isinstance(items[int(index)], Mapping):
                    raise ConfigError(f"{key}.{index}: {key} has {len(items)} entries, so no entry {index} to change")
                items[int(index)] = _merge(items[int(index)], item, f"{key}.{index}.")
            out[name] = tuple(items)
        else:
            out[name] = value
    return out


def _nested(path: list[str], value: Any) -> dict[str, Any]:
    for name in reversed(path):
        value = {name: value}
    return value


def explicit_settings(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The keys the user set (YAML file, then overrides on top), checked, as a partial tree."""
    tree: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
        try:
            tree = coerce_tree(data, RLConfig)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
    if isinstance(overrides, str):
        raise ConfigError("overrides must be a list of 'key=value' strings, not one string")
    for text in overrides:
        try:
            key_path, value = parse_override(text)
        except ConfigError as err:
            raise ConfigError(f"command-line override {text!r}: {err}") from None
        tree = _merge(tree, _nested(key_path, value))
    return tree


def resolve(explicit: Mapping[str, Any]) -> RLConfig:
    """The config from explicitly set keys: preset first, explicit keys on top, derived defaults, validated."""
    algo = explicit.get("algo", {})
    preset = algo.get("preset", AlgoConfig.preset)
    sampling = explicit.get("rollout", {}).get("sampling", {})
    max_new_tokens = sampling.get("max_new_tokens", SamplingParams.max_new_tokens)
    tree = _merge({"algo": preset_values(preset, max_new_tokens)}, explicit)
    cfg = build(RLConfig, tree)
    if cfg.model.tokenizer_path is None:
        cfg = replace(cfg, model=replace(cfg.model, tokenizer_path=cfg.model.hf_path))
    if cfg.algo.rollout_correction == "auto":  # off-policy correction is on by default where samples are stale
        correction = "tis" if cfg.trainer.mode == "async" else "none"
        cfg = replace(cfg, algo=replace(cfg.algo, rollout_correction=correction))
    for note in validate(cfg):
        log.warning("config: %s", note)
    _PRESET_APPLIED[id(cfg.algo)] = cfg.algo
    return cfg


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RLConfig:
    """Read YAML ``path`` (None = defaults only), apply ``key=value`` overrides, apply the preset, validate.

    Precedence: defaults < ``algo.preset`` < keys in the YAML file < overrides. The ``plugins`` modules are
    imported first (modules next to the config file and in the working directory are found). Raises ConfigError
    naming the key for unknown keys, ill-typed values and invalid combinations; logs notes (warnings).
    """
    explicit = explicit_settings(path, overrides)
    import_plugins(explicit.get("plugins", ()), path)
    return resolve(explicit)


# ---------------------------------------------------------------------------------------------- plugins
# The user's plugin modules register rewards, environments or tools (`register_reward`, ...) or are named by a dotted
# path (`data.reward: my_rewards:score`); every rank under torchrun loads the config, so every rank imports them.
def plugin_folders(config_path: str | Path | None) -> list[Path]:
    """Where plugin modules are found besides sys.path: the config file's folder, then the working directory."""
    folders = [Path(config_path).absolute().parent] if config_path is not None else []
    return [*folders, Path(os.getcwd())]


def add_plugin_folders(config_path: str | Path | None) -> None:
    """Make modules next to the config file and in the working directory importable (appended to sys.path, so a
    plugin never shadows an installed package)."""
    for folder in plugin_folders(config_path):
        if str(folder) not in sys.path:
            sys.path.append(str(folder))


def import_plugins(modules: Iterable[str], config_path: str | Path | None = None) -> None:
    """Import each of `modules` (the `plugins` key); a ConfigError names one that does not import and where it was
    looked for."""
    add_plugin_folders(config_path)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            where = ", ".join(str(f) for f in plugin_folders(config_path))
            raise ConfigError(
                f"plugins: cannot import {name!r} ({err}); searched {where} and PYTHONPATH: put the module next to "
                "the config file or in the working directory, or add its folder to PYTHONPATH"
            ) from err


# The algo sections `resolve` made (the preset is in their values already), by id: `configure` keeps them whole.
_PRESET_APPLIED: weakref.WeakValueDictionary[int, AlgoConfig] = weakref.WeakValueDictionary()


def configure(cfg: RLConfig, overrides: Sequence[str] = ()) -> RLConfig:
    """A config built in Python (``RLConfig(model=ModelConfig(hf_path=...), ...)``), resolved and validated as
    `load_config` resolves a file that sets the keys whose values differ from the defaults: ``algo.preset`` fills the
    ``algo`` keys left at their defaults, ``plugins`` are imported first, ``overrides`` apply on top. An ``algo``
    section that `load_config` made is kept whole (its preset is applied already)."""
    defaults = build(RLConfig, {"model": {"hf_path": cfg.model.hf_path}})
    explicit = _merge(_changed(cfg, defaults), {"model": {"hf_path": cfg.model.hf_path}})
    if _PRESET_APPLIED.get(id(cfg.algo)) is cfg.algo:
        explicit["algo"] = to_dict(cfg.algo)
    explicit = _merge(explicit, explicit_settings(None, overrides))
    import_plugins(explicit.get("plugins", ()))
    return resolve(explicit)


def _changed(obj: object, default: object) -> dict[str, Any]:
    """The fields of config section `obj` that differ from `default`'s, as a partial tree of plain values."""
    out: dict[str, Any] = {}
    for f in fields(obj):  # type: ignore[arg-type]
        value, base = getattr(obj, f.name), getattr(default, f.name)
        if is_dataclass(value) and type(value) is type(base) and not isinstance(value, type):
            if sub := _changed(value, base):
                out[f.name] = sub
        elif value != base:
            out[f.name] = _plain(value)
    return out


def from_dict(data: Mapping[str, Any]) -> RLConfig:
    """The config exactly as ``data`` says (types checked, missing keys = defaults); inverse of `to_dict`.

    No preset is applied and nothing is validated across fields: that is `load_config`'s job.
    """
    return build(RLConfig, data)


def format_config(cfg: RLConfig) -> str:
    """The config as YAML, for printing at start-up and saving with the run."""
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


def dump_yaml(cfg: RLConfig, path: str | Path) -> Path:
    """Write the resolved config to ``path`` (parents created); `load_config(path)` reads it back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    presets = ", ".join(PRESETS)
    header = (
        "# megatron_rl config, resolved (defaults, preset and overrides applied).\n"
        f"# Re-run with: megatron-rl train {path.name}   (algo.preset is one of: {presets})\n"
    )
    path.write_text(header + format_config(cfg))
    return path
