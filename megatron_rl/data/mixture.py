"""A weighted mixture of several endless, resumable streams (`data.train: [{path, weight}, ...]`).

Draw i comes from the source picked by a generator seeded with (seed, i) alone, so which source serves draw i does
not depend on what was drawn before: a run resumed at draw i makes the same picks, and each source (its own
resumable iterator) continues from its own position.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Resumable(Protocol):
    """An endless iterator whose position is `state_dict()` and can be restored with `load_state_dict`."""

    def __next__(self) -> Any: ...

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Mixture:
    """Draws from `sources` in proportion to `weights` (normalised); resumable from `state_dict()`."""

    def __init__(self, sources: Sequence[Resumable], weights: Sequence[float], *, seed: int):
        if not sources or len(sources) != len(weights):
            raise ValueError(f"a mixture needs one weight per source ({len(sources)} sources, {len(weights)} weights)")
        if any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, got {list(weights)}")
        self.sources = list(sources)
        self.weights = [float(w) for w in weights]
        self.seed = seed
        self.draws = 0
        self._bounds = list(itertools.accumulate(self.weights))

    def source_of(self, draw: int) -> int:
        """The index of the source that serves draw `draw` (0-based)."""
        u = random.Random(f"mixture:{self.seed}:{draw}").random() * self._bounds[-1]
        return min(bisect.bisect_right(self._bounds, u), len(self.sources) - 1)

    def __iter__(self) -> Mixture:
        return self

    def __next__(self) -> Any:
        item = next(self.sources[self.source_of(self.draws)])
        self.draws += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "seed": self.seed,
            "weights": list(self.weights),
            "sources": [dict(s.state_dict()) for s in self.sources],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`; the seed, the weights and the number of sources must match (else ValueError)."""
        if "sources" not in state:
            raise ValueError(
                "the checkpoint's prompt position is of one dataset, but data.train is now a mixture of "
                f"{len(self.sources)}: resume with the checkpoint's data.train"
            )
        if len(state["sources"]) != len(self.sources):
            raise ValueError(
                f"the checkpoint's mixture has {len(state['sources'])} datasets but data.train lists "
                f"{len(self.sources)}"
            )
        for key, mine in (("seed", self.seed), ("weights", self.weights)):
            if state[key] != mine:
                raise ValueError(f"the checkpoint's mixture has {key}={state[key]!r} but this run has {mine!r}")
        if int(state["draws"]) < 0:
            raise ValueError(f"invalid mixture position draws={state['draws']}")
        for source, source_state in zip(self.sources, state["sources"], strict=True):
            source.load_state_dict(source_state)
        self.draws = int(state["draws"])
