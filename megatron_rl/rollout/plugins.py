"""Registries of named extensions, and loading user extensions by dotted path ("package.module:name" or
"package.module.name").

slime's extension points (custom reward, custom generate, custom filter) are such paths; environments, custom
generate functions, tool-call formats and tools register and load theirs here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")


def load_dotted(path: str, kind: str) -> Any:
    """The object at `path`; `kind` ("reward", "environment", ...) names it in errors. A ValueError when `path` is
    not a dotted path or does not import."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"{kind} {path!r} is not a dotted path ('package.module:name')")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load {kind} {path!r}: {err}") from err


def lookup(name: str, registry: Mapping[str, Any], kind: str) -> Any:
    """`registry[name]` (a string value is a dotted path, loaded now), else the object at the dotted path `name`; a
    ValueError naming the choices otherwise."""
    if name in registry:
        found = registry[name]
        return load_dotted(found, kind) if isinstance(found, str) else found
    if ":" not in name and "." not in name:
        raise ValueError(f"unknown {kind} {name!r}: not one of {sorted(registry)} nor a dotted path")
    return load_dotted(name, kind)


def lookup_callable(name: str | Callable, registry: Mapping[str, Any], kind: str, expected: str) -> Callable:
    """`name` itself if callable, else `lookup`'s result, which must be callable (`expected` names what it should be
    in the error)."""
    if callable(name):
        return name
    found = lookup(name, registry, kind)
    if not callable(found):
        raise ValueError(f"{kind} {name!r} is a {type(found).__name__}, not {expected}")
    return found


def register_in(registry: MutableMapping[str, Any], kind: str, name: str) -> Callable[[T], T]:
    """Decorator: add the object to `registry` under `name` (a ValueError when the name is taken)."""

    def add(obj: T) -> T:
        if name in registry:
            raise ValueError(f"{kind} {name!r} is already registered")
        registry[name] = obj
        return obj

    return add
