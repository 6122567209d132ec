"""Loading user extensions by dotted path ("package.module:name" or "package.module.name").

slime's extension points (custom reward, custom generate, custom filter) are such paths; rewards, environments,
custom generate functions and tools all load theirs here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


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
    """`registry[name]`, else the object at the dotted path `name`; a ValueError naming the choices otherwise."""
    if name in registry:
        return registry[name]
    if ":" not in name and "." not in name:
        raise ValueError(f"unknown {kind} {name!r}: not one of {sorted(registry)} nor a dotted path")
    return load_dotted(name, kind)
