"""Weight syncs under LoRA (`rollout_phase.WeightSync`, `megatron_backend/lora/sync_payload.py`), one process, fp32.

* Merged: a start's first sync sends every tensor; after a LoRA update only the tensors the adapters touch go
  (their `W + (α/r) B A`), exactly their bytes, and the local engine then scores as the trainer does. With
  `rollout.release_memory`, after a failed sync and when asked (a restarted server) every tensor goes again.
* A partial sync that leaves a tensor stale is caught by the verifier although only the first sync is scheduled.
* Adapter-only: the base once (adapters off), then the adapters alone, in peft's names.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_rl.config.options import LoRAOptions
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.rollout.engine import RolloutEngineError
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.rollout.sync_probe import WeightSyncMismatch
from megatron_rl.trainer.guards.sync_verification import SyncVerifier, probe_log_probs
from megatron_rl.trainer.rollout_phase import WeightSync
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.megatron_backend.lora.test_lora_adapters import _actor, _random_b

pytestmark = pytest.mark.usefixtures("megatron_world")
LORA = LoRAOptions(rank=4, alpha=16.0)  # attention, the dense layer's MLP, shared experts (none here), routed experts
ADAPTED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # their HF projections
PROBE = [[3, 17, 5, 9, 12, 7, 30, 41, 8], [11, 2, 19, 8, 44, 6, 21]]
TOL = 1e-5  # trainer vs local engine in fp32, as the LoRA loop's `mismatch/logp_abs_diff` (test_lora_loop.py)


def _file_tensors(model_dir: Path) -> dict[str, int]:
    """The checkpoint's tensors and their element counts (read from the header)."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not a dict)


def _bytes(model_dir: Path, adapted_only: bool) -> tuple[float, float]:
    """`(bytes, tensors)` an fp32 sync of every tensor, or of the adapted projections only, sends."""
    tensors = {n: k for n, k in _file_tensors(model_dir).items() if not adapted_only or n.split(".")[-2] in ADAPTED}
    return 4.0 * sum(tensors.values()), float(len(tensors))


def _logp_error(engine: LocalEngine, actor) -> float:
    (served,) = engine.score_prompts(PROBE)
    want = probe_log_probs(actor, PROBE)
    pairs = zip(served.log_probs, want, strict=True)
    return max(abs(a - b) for got, exp in pairs for a, b in zip(got, exp, strict=True))


def _metrics(sync: WeightSync) -> tuple[float, float, float]:
    m = sync.pop_metrics()
    return m["sync/bytes"], m["sync/tensors"], m["sync/full_syncs"]


@pytest.mark.parametrize("lora", [LORA, dataclasses.replace(LORA, share_expert_a=True)], ids=["own_a", "shared_a"])
def test_after_a_lora_update_only_the_adapted_tensors_go_and_the_engine_scores_as_the_trainer(
    tiny_moe_dir: Path, lora: LoRAOptions
) -> None:
    actor, engine = _actor(tiny_moe_dir, lora), LocalEngine(tiny_moe_dir)
    sync = WeightSync(actor, engine, RolloutConfig())
    full, partial = _bytes(tiny_moe_dir, False), _bytes(tiny_moe_dir, True)
    sync.send(0)
    assert _metrics(sync) == (*full, 1.0)
    _random_b(actor)  # a LoRA update
    assert _logp_error(engine, actor) > 1e-3  # the engine is behind the trainer
    sync.send(1)
    assert _metrics(sync) == (*partial, 0.0)
    assert _logp_error(engine, actor) < TOL
    assert partial[0] < full[0]  # 864 of 937 KiB: on this tiny model the adapted experts are nearly everything


def test_every_tensor_goes_with_release_memory_after_a_failure_and_when_asked(tiny_moe_dir: Path) -> None:
    actor = _actor(tiny_moe_dir, LORA)
    full, partial = _bytes(tiny_moe_dir, False), _bytes(tiny_moe_dir, True)

    engine = LocalEngine(tiny_moe_dir)
    released = WeightSync(actor, engine, dataclasses.replace(RolloutConfig(), release_memory=True))
    released.send(0)
    _random_b(actor, seed=1)
    engine.release_memory(["weights"])  # as `ColocatedMemory` does around training: the weights are discarded
    engine.resume_memory(["weights"])
    released.send(1)
    assert _metrics(released) == (2 * full[0], 2 * full[1], 2.0)
    assert _logp_error(engine, actor) < TOL

    failing = _FailsOnce(LocalEngine(tiny_moe_dir))
    sync = WeightSync(actor, failing, RolloutConfig())  # type: ignore[arg-type]
    sync.send(0)
    _random_b(actor, seed=2)
    with pytest.raises(RolloutEngineError):
        sync.send(1)  # failed after the first bucket: the engine holds mixed weights
    sync.pop_metrics()
    sync.send(2)
    assert _metrics(sync) == (*full, 1.0)
    sync.send(3, full=True)
    sync.send(4)
    assert _metrics(sync) == (full[0] + partial[0], full[1] + partial[1], 1.0)
    assert _logp_error(failing.engine, actor) < TOL


def test_a_tensor_partial_syncs_leave_stale_is_caught_by_the_verifier(tiny_moe_dir: Path) -> None:
    """`verify_sync=first` schedules sync 0 only; the first partial sync is verified too, and catches an engine
    that missed layer 0's q_proj (sync 0 passes: with B = 0 its base q_proj is what the trainer computes with)."""
    actor = _actor(tiny_moe_dir, LORA)
    engine = _DropsOne(LocalEngine(tiny_moe_dir), "model.layers.0.self_attn.q_proj.weight")
    verifier = SyncVerifier("first", 10, PROBE)
    sync = WeightSync(actor, engine, RolloutConfig(), verifier)  # type: ignore[arg-type]
    sync.send(0)
    assert sync.pop_metrics()["sync/probe_logp_diff_max"] < TOL
    _random_b(actor)
    with pytest.raises(WeightSyncMismatch, match="did not take effect on local engine"):
        sync.send(1)


def test_adapter_only_sends_the_base_once_then_the_adapters_alone(tiny_moe_dir: Path) -> None:
    lora = LoRAOptions(rank=4, alpha=16.0, targets=("attention",))
    actor = _actor(tiny_moe_dir, lora)
    _random_b(actor)
    engine = _AdapterRecorder()
    sync = WeightSync(actor, engine, dataclasses.replace(RolloutConfig(), lora_sync="adapter"))
    hf = read_hf_config(tiny_moe_dir)
    h, hd, heads, groups = hf["hidden_size"], hf["head_dim"], hf["num_attention_heads"], hf["num_key_value_heads"]
    per_layer = 3 * lora.rank * h + lora.rank * (heads + 2 * groups) * hd + lora.rank * (heads * hd + h)  # q,k,v; o
    adapter_bytes, adapter_tensors = 4.0 * per_layer * hf["num_hidden_layers"], 8.0 * hf["num_hidden_layers"]
    full = _bytes(tiny_moe_dir, False)

    sync.send(0)
    assert _metrics(sync) == (full[0] + adapter_bytes, full[1] + adapter_tensors, 1.0)
    q = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(engine.weights[q], f.get_tensor(q))  # the base, not the merged weight
    sync.send(1)
    assert _metrics(sync) == (adapter_bytes, adapter_tensors, 0.0)
    assert engine.versions == ["step-0", "step-0", "step-1"]  # weights, adapter; adapter
    tensors, config = engine.adapter
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert (config["r"], config["lora_alpha"], config["target_parameters"]) == (4, 16.0, None)
    assert {m.rsplit(".", 1)[-1] for m in config["target_modules"]} == {"q_proj", "k_proj", "v_proj", "o_proj"}


class _FailsOnce:
    """The local engine, whose second update fails after its first bucket."""

    def __init__(self, engine: LocalEngine):
        self.engine, self.updates = engine, 0

    def update_weights(self, buckets, version: str) -> None:
        self.updates += 1
        if self.updates != 2:
            return self.engine.update_weights(buckets, version)
        self.engine.update_weights([next(iter(buckets))], version)
        raise RolloutEngineError("the server died mid-update")


class _DropsOne(_FailsOnce):
    """The local engine, which never loads the tensor `name`."""

    def __init__(self, engine: LocalEngine, name: str):
        super().__init__(engine)
        self.name = name

    def update_weights(self, buckets, version: str) -> None:
        self.engine.update_weights(([(n, t) for n, t in b if n != self.name] for b in buckets), version)

    def score_prompts(self, prompts, top_k: int = 0):
        return self.engine.score_prompts(prompts, top_k)


class _AdapterRecorder:
    """An engine that serves adapters (`AdapterEngine`) and records what it is sent."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.adapter: tuple[dict, dict] | None = None
        self.versions: list[str] = []

    def update_weights(self, buckets, version: str) -> None:
        self.weights.update((n, t.clone()) for bucket in buckets for n, t in bucket)
        self.versions.append(version)

    def load_adapter(self, tensors: dict, config: dict, version: str) -> None:
        self.adapter = (tensors, config)
        self.versions.append(version)
