"""Releasing and resuming a rollout engine's memory (SGLang's contract, `rollout.engine_memory`): the local engine
really frees its weights, refuses to generate from released or never-refilled memory, and after the refill
generates exactly as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engine import RolloutEngineError
from megatron_rl.rollout.engines.engine_memory import EngineMemory, check_tags
from megatron_rl.rollout.engines.local_engine import LocalEngine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
PROMPTS = [[3, 4, 5], [6, 7]]


def test_release_frees_weights_and_resume_plus_update_restores_them(tiny_dir: Path) -> None:
    engine = LocalEngine(tiny_dir)
    weights = {name: t.clone() for name, t in engine.model.state_dict().items()}
    before = [s.response_ids for s in engine.generate(PROMPTS, GREEDY)]
    full = engine.resident_weight_bytes()
    assert full == sum(p.numel() * p.element_size() for p in engine.model.parameters())

    engine.release_memory()
    assert engine.resident_weight_bytes() == 0
    released = r"memory released: resume_memory\(\['cuda_graph', 'kv_cache', 'weights'\]"
    with pytest.raises(RolloutEngineError, match=released):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(RolloutEngineError, match="weights released"):
        engine.update_weights([list(weights.items())], "v1")

    engine.resume_memory(["kv_cache", "cuda_graph"])
    with pytest.raises(RolloutEngineError, match=r"\['weights'\] memory released"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume_memory(["weights"])
    assert engine.resident_weight_bytes() == full
    with pytest.raises(RolloutEngineError, match="released and resumed but not updated"):
        engine.generate(PROMPTS, GREEDY)

    engine.update_weights([list(weights.items())], "v1")
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert [s.response_ids for s in engine.generate(PROMPTS, GREEDY)] == before
    assert engine.weight_version == "v1"

    # Other values this time: the re-allocated memory may hold the old bytes, the update must overwrite them.
    engine.release_memory()
    engine.resume_memory()
    changed = {name: t + 0.5 for name, t in weights.items()}
    engine.update_weights([list(changed.items())], "v2")
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, changed[name]), name


def test_release_and_resume_are_idempotent_and_caches_keep_weights(tiny_dir: Path) -> None:
    engine = LocalEngine(tiny_dir)
    before = [s.response_ids for s in engine.generate(PROMPTS, GREEDY)]
    full = engine.resident_weight_bytes()
    engine.release_memory(["kv_cache", "cuda_graph"])
    engine.release_memory(["kv_cache"])  # already released: nothing to do
    assert engine.resident_weight_bytes() == full > 0
    engine.resume_memory()
    engine.resume_memory()
    assert [s.response_ids for s in engine.generate(PROMPTS, GREEDY)] == before  # weights were never released


def test_memory_state_and_tags() -> None:
    assert check_tags(None) == ("weights", "kv_cache", "cuda_graph")
    assert check_tags(["kv_cache", "weights"]) == ("weights", "kv_cache")
    with pytest.raises(ValueError, match=r"unknown memory tags \['kv'\]"):
        check_tags(["kv"])
    memory = EngineMemory()
    assert memory.releasable(["weights"]) == ("weights",) and memory.resumable(None) == ()
    memory.mark_released(("weights", "kv_cache"))
    assert memory.releasable(None) == ("cuda_graph",)
    memory.mark_resumed(("weights",))
    assert memory.weights_undefined and memory.released == {"kv_cache"}
    memory.reset()
    memory.check_can_generate()
