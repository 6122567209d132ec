"""What a rollout engine holds on its accelerator while colocated training runs: SGLang's memory contract.

SGLang (`/release_memory_occupation`, `/resume_memory_occupation`; the tags are those of SGLang's
`srt/constants.py`) frees the memory of the tagged parts: ``weights`` are *discarded* (without
`--enable-weights-cpu-backup`), ``kv_cache`` and ``cuda_graph`` buffers are dropped; resuming re-allocates
them, and resumed weights are undefined until the next weight update. `EngineMemory` keeps that state for an
engine and refuses what would silently generate from garbage: generating while something is released, or from
resumed weights that no update has filled. Those refusals are `RolloutEngineError`s: the trainer's recovery
(restart what died, re-send the weights) repairs a server that lost its memory state.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.rollout.engine import RolloutEngineError

__all__ = ["CACHE_TAGS", "MEMORY_TAGS", "EngineMemory", "check_tags"]

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
CACHE_TAGS = ("kv_cache", "cuda_graph")  # everything but the weights


def check_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """``tags`` validated (``None`` = all), in `MEMORY_TAGS` order."""
    if tags is None:
        return MEMORY_TAGS
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; valid: {list(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if t in tags)


class EngineMemory:
    """Released parts of an engine's memory and whether its weights still need an update."""

    def __init__(self) -> None:
        self.released: set[str] = set()
        self.weights_undefined = False  # resumed after a release, not yet filled by update_weights

    def releasable(self, tags: Sequence[str] | None) -> tuple[str, ...]:
        """Those of ``tags`` (None = all) not released yet."""
        return tuple(t for t in check_tags(tags) if t not in self.released)

    def resumable(self, tags: Sequence[str] | None) -> tuple[str, ...]:
        """Those of ``tags`` (None = all) that are released."""
        return tuple(t for t in check_tags(tags) if t in self.released)

    def mark_released(self, tags: Sequence[str]) -> None:
        self.released.update(tags)

    def mark_resumed(self, tags: Sequence[str]) -> None:
        self.released.difference_update(tags)
        if "weights" in tags:
            self.weights_undefined = True

    def updated(self) -> None:
        """A full weight update landed."""
        self.weights_undefined = False

    def check_can_update(self) -> None:
        if "weights" in self.released:
            raise RolloutEngineError(
                "update_weights with the engine's weights released: resume_memory(['weights']) first"
            )

    def check_can_generate(self) -> None:
        if self.released:
            raise RolloutEngineError(
                f"generate with the engine's {sorted(self.released)} memory released: "
                f"resume_memory({sorted(self.released)}) first"
            )
        if self.weights_undefined:
            raise RolloutEngineError(
                "generate from weights that were released and resumed but not updated since: call update_weights"
            )

    def reset(self) -> None:
        """The engine was restarted with everything resident and its checkpoint's weights."""
        self.released.clear()
        self.weights_undefined = False
