"""The config tree's field helper: a dataclass field with its help text and load-time checks."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any


def setting(default: Any = MISSING, *, help: str, default_factory: Any = MISSING, **checks: Any) -> Any:
    """A dataclass field with help text and optional checks (``ge``, ``gt``, ``le``, ``registry``)."""
    metadata = {"help": help, **checks}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)
