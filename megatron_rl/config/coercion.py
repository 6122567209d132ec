"""Plain nested dicts <-> the typed config tree, checked against the dataclasses' annotations.

Every value is checked against its field's annotation (bool, int, float, str, Literal, Optional,
tuple[X, ...], nested dataclasses) and the field's metadata bounds (``ge``, ``gt``, ``le``) and
``registry``. Errors name the full dotted key, the value and what was expected; unknown keys list
the section's keys and the closest one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from megatron_rl.config.errors import ConfigError

NoneType = type(None)


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field of a config dataclass with its resolved annotation."""

    name: str
    type: Any
    field: dataclasses.Field

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def required(self) -> bool:
        return self.field.default is dataclasses.MISSING and self.field.default_factory is dataclasses.MISSING

    def default(self) -> Any:
        if self.field.default is not dataclasses.MISSING:
            return self.field.default
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        raise KeyError(self.name)


@functools.cache
def field_specs(cls: type) -> dict[str, FieldSpec]:
    """The fields of dataclass ``cls`` by name, in declaration order, with annotations resolved."""
    hints = typing.get_type_hints(cls)
    return {f.name: FieldSpec(f.name, hints[f.name], f) for f in dataclasses.fields(cls) if f.init}


def is_section(tp: Any) -> bool:
    """Whether ``tp`` is a config section (a dataclass type)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def suggest(word: str, options: typing.Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or ''."""
    by_lower = {o.lower(): o for o in options}
    match = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[match[0]]!r}?)" if match else ""


def unknown_key_error(key: str, cls: type) -> ConfigError:
    prefix, _, name = key.rpartition(".")
    valid = list(field_specs(cls))
    where = f"section {prefix!r}" if prefix else "the top level"
    by_lower = {v.lower(): v for v in valid}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"; did you mean {join(prefix, by_lower[close[0]])!r}?" if close else ""
    return ConfigError(f"unknown key {key!r}: valid keys of {where} are {', '.join(valid)}{hint}")


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) is Union or isinstance(tp, types.UnionType):
        return typing.get_args(tp)
    return None


def describe_type(tp: Any) -> str:
    """A short human description of an annotation, e.g. ``one of 'off', 'R2', 'R3'`` or ``integer or null``."""
    args = _union_args(tp)
    if args is not None:
        parts = [describe_type(a) for a in args if a is not NoneType]
        return " or ".join(parts) + (" or null" if NoneType in args else "")
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {describe_type(args[0])}"
        return "list of " + ", ".join(describe_type(a) for a in args)
    if is_section(tp):
        return f"mapping ({tp.__name__})"
    if typing.get_origin(tp) is dict:
        return "mapping of options"
    return {bool: "bool (true/false)", int: "integer", float: "number", str: "string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def accepts_str(tp: Any) -> bool:
    """Whether a field of type ``tp`` can hold a string (so command-line text is kept as written)."""
    args = _union_args(tp)
    if args is not None:
        return any(accepts_str(a) for a in args)
    if typing.get_origin(tp) is Literal:
        return any(isinstance(a, str) for a in typing.get_args(tp))
    return tp is str


def _bad(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"{key}={value!r}: expected {describe_type(tp)}, got {type(value).__name__}")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as annotation ``tp`` requires (sections become dicts here; `build` makes dataclasses)."""
    args = _union_args(tp)
    if args is not None:
        if value is None:
            if NoneType in args:
                return None
            raise _bad(key, value, tp)
        options = [a for a in args if a is not NoneType]
        if len(options) == 1 and options[0] not in (bool, int, float, str):
            return coerce(value, options[0], key)  # Optional[Literal/tuple/section]: its own message
        for arg in options:
            try:
                return coerce(value, arg, key)
            except ConfigError:
                pass
        raise _bad(key, value, tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if any(value == o and type(value) is type(o) for o in allowed):
            return value
        raise ConfigError(
            f"{key}={value!r}: must be one of {', '.join(repr(o) for o in allowed)}{suggest(value, map(str, allowed))}"
        )
    if origin is tuple:
        items = list(value) if isinstance(value, list | tuple) else [value]
        targs = typing.get_args(tp)
        if len(targs) == 2 and targs[1] is Ellipsis:
            return tuple(coerce(v, targs[0], f"{key}[{i}]") for i, v in enumerate(items))
        if len(items) != len(targs):
            raise ConfigError(f"{key}={value!r}: expected {len(targs)} items ({describe_type(tp)})")
        return tuple(coerce(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(items, targs, strict=True)))
    if origin is dict:  # free-form options (a plug-in's keyword arguments): a mapping with string keys
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}={value!r}: expected a mapping of option names to values")
        return dict(value)
    if is_section(tp):
        if isinstance(value, tp):
            return to_dict(value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}={value!r}: {key!r} is a section; expected a mapping of its keys")
        return coerce_tree(value, tp, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _bad(key, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _bad(key, value, tp)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isnan(value):
                raise ConfigError(f"{key}: NaN is not a valid value")
            return float(value)
        raise _bad(key, value, tp)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):  # YAML `run_name: 42`
            return str(value)
        raise _bad(key, value, tp)
    if tp is Any or isinstance(value, tp):
        return value
    raise _bad(key, value, tp)


def _check_metadata(value: Any, spec: FieldSpec, key: str) -> None:
    if value is None:
        return
    meta = spec.field.metadata
    if "ge" in meta and not value >= meta["ge"]:
        raise ConfigError(f"{key}={value!r}: must be >= {meta['ge']}")
    if "gt" in meta and not value > meta["gt"]:
        raise ConfigError(f"{key}={value!r}: must be > {meta['gt']}")
    if "le" in meta and not value <= meta["le"]:
        raise ConfigError(f"{key}={value!r}: must be <= {meta['le']}")
    registry = meta.get("registry")
    if registry is not None and value not in registry:
        raise ConfigError(
            f"{key}={value!r}: not a registered {registry.kind}; valid names: {', '.join(registry.names())}"
            f"{suggest(value, registry.names())}"
        )


def coerce_field(value: Any, spec: FieldSpec, key: str) -> Any:
    """``value`` checked and converted for field ``spec`` (type, bounds, registry)."""
    value = coerce(value, spec.type, key)
    _check_metadata(value, spec, key)
    return value


def coerce_tree(data: Mapping[str, Any], cls: type, prefix: str = "") -> dict[str, Any]:
    """A partial tree for section ``cls`` with every present value checked and converted; no defaults added."""
    specs = field_specs(cls)
    out: dict[str, Any] = {}
    for name, value in data.items():
        key = join(prefix, str(name))
        if name not in specs:
            raise unknown_key_error(key, cls)
        out[name] = coerce_field(value, specs[name], key)
    return out


def build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Dataclass ``cls`` from a (possibly partial) tree; missing keys take their defaults."""
    data = coerce_tree(data, cls, prefix)
    kwargs: dict[str, Any] = {}
    for name, spec in field_specs(cls).items():
        key = join(prefix, name)
        if name in data:
            kwargs[name] = build(spec.type, data[name], key) if is_section(spec.type) else _sections_in(
                spec.type, data[name], key
            )
        elif spec.required and is_section(spec.type):
            kwargs[name] = build(spec.type, {}, key)  # reports the section's own required keys
        elif spec.required:
            raise ConfigError(f"{key} is required: {spec.help}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:  # the reused dataclasses check themselves (e.g. LayoutError)
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from None


def _sections_in(tp: Any, value: Any, key: str) -> Any:
    """`value` (as `coerce` returned it) with the sections of a list of sections built, e.g. `data.reward`'s
    `str | tuple[RewardSpec, ...]`."""
    item = list_item_section(tp)
    if item is not None and isinstance(value, tuple):
        return tuple(build(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    return value


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """A config dataclass as nested plain dicts/lists/scalars (YAML-ready), in field order."""
    cls: type = type(obj)  # mypy wrongly finds type[Any] unhashable for the cache
    return {name: _plain(getattr(obj, name)) for name in field_specs(cls)}


def walk_fields(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, FieldSpec]]:
    """Every field of the tree under ``cls`` as (dotted key, spec), sections before their fields."""
    for name, spec in field_specs(cls).items():
        key = join(prefix, name)
        yield key, spec
        if is_section(spec.type):
            yield from walk_fields(spec.type, key)


def section_of(cls: type, path: list[str]) -> tuple[type, FieldSpec]:
    """The section class holding dotted ``path``'s last field, and that field; unknown keys raise. An index steps
    into a list of sections: ``rollout.side_models.0.urls``."""
    i = 0
    while i < len(path):
        name = path[i]
        specs = field_specs(cls)
        if name not in specs:
            raise unknown_key_error(".".join(path[: i + 1]), cls)
        spec = specs[name]
        if i == len(path) - 1:
            return cls, spec
        item = list_item_section(spec.type)
        if item is not None and path[i + 1].isdigit() and i + 2 < len(path):
            cls, i = item, i + 2
            continue
        if not is_section(spec.type):
            raise ConfigError(f"{'.'.join(path[: i + 1])!r} is a value, not a section; it has no key {path[i + 1]!r}")
        cls, i = spec.type, i + 1
    raise ConfigError("empty key")


def list_item_section(tp: Any) -> type | None:
    """The section of a list of sections (``tuple[SideModel, ...]``, also inside a union), else None."""
    for arm in _union_args(tp) or (tp,):
        targs = typing.get_args(arm)
        if typing.get_origin(arm) is tuple and len(targs) == 2 and targs[1] is Ellipsis and is_section(targs[0]):
            return targs[0]
    return None
