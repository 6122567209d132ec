"""The interface every rollout engine implements (local HF engine, SGLang servers)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.sample import Sample

NamedTensorBucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ServedScores:
    """What one replica of an engine (the local model, one SGLang server) computes for a weight-sync probe."""

    replica: str  # "local engine" or the server's URL
    version: str  # the weight version the replica itself reports holding
    dtype: str  # the dtype it computes in ("float32", "bfloat16", ...)
    log_probs: list[list[float]]  # per prompt: log p(prompt[t] | prompt[:t]) for t >= 1, temperature 1
    top_ids: list[list[list[int]]] | None = None  # score_prompts(top_k=k): per prompt, per t >= 1, the k likeliest
    top_log_probs: list[list[list[float]]] | None = None  # ... and their log-probs, likeliest first


class RolloutEngineError(RuntimeError):
    """The engine failed in a way `RolloutEngine.recover()` may repair (a dead or hung server)."""


class RolloutEngine(Protocol):
    """Generates samples and takes new weights; implementations: `LocalEngine`, `SGLangEngine`."""

    @property
    def weight_version(self) -> str: ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, return_routed_experts: bool = False
    ) -> list[Sample]:
        """`n` samples per prompt, grouped prompt by prompt (sample i*n+j is prompt i's j-th)."""
        ...

    def update_weights(self, buckets: Iterable[NamedTensorBucket], version: str) -> None:
        """Load HF-named full tensors (streamed in buckets) and stamp later samples with `version`."""
        ...

    def score_prompts(self, prompts: list[list[int]], top_k: int = 0) -> list[ServedScores]:
        """Prefill only: each replica's teacher-forced log-probs of `prompts` (with `top_k`, also the `top_k` most
        likely tokens at each position and their log-probs) and the version it reports."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self) -> None: ...

    def healthy(self) -> bool: ...

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the accelerator memory of `tags` ("weights", "kv_cache", "cuda_graph"; None = all) for a colocated
        trainer; released weights are discarded (`engine_memory.EngineMemory` has the contract)."""
        ...

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Re-allocate released memory; resumed weights need `update_weights` before the next `generate`."""
        ...

    def recover(self) -> list[str]:
        """Restart what failed (dead or unresponsive servers); the names restarted. Restarted servers serve
        the checkpoint they were launched from again: the caller re-sends the current weights."""
        ...

    def shutdown(self) -> None: ...


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that serves LoRA adapters on its base weights itself (`SGLangEngine`, `rollout.lora_sync=adapter`)."""

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: str) -> None:
        """Generate with this adapter (peft's tensor names, its `adapter_config.json`) from now on, replacing the
        last one; later samples carry `version`."""
        ...
