"""Name -> function registries, so that adding an algorithm is one decorated function.

The registries created from this class (policy losses, advantage estimators, KL estimators, aggregation
modes) are the only module-level mutable state in ``megatron_rl.algorithms``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named collection of functions of one kind (e.g. ``"policy loss"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding ``fn`` under ``name``; registering a name twice is an error."""

        def add(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """Return the function registered as ``name``; unknown names raise ValueError listing valid ones."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries


class NameSet:
    """A config field's valid names: a registry's and names served elsewhere (``algo.advantage``'s ``gae``, which
    needs a critic's values, not a function of the group rewards)."""

    def __init__(self, registry: Registry, extra: tuple[str, ...]) -> None:
        self.kind, self._registry, self._extra = registry.kind, registry, extra

    def names(self) -> tuple[str, ...]:
        return tuple(sorted((*self._registry.names(), *self._extra)))

    def __contains__(self, name: object) -> bool:
        return name in self._extra or name in self._registry
