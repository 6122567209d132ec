"""The launch planner prices LoRA (`model.lora`): the adapter count equals what the Megatron actor builds (an A
shared across experts too), the frozen base needs no gradients or optimizer state (Qwen3-30B-A3B fits where full
training is refused), and the KL reference (the base with the adapters off) costs no host memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.config.options import LoRAOptions
from megatron_rl.launch.lora_memory import lora_params
from megatron_rl.launch.plan import ClusterSpec, PlanError, format_plan, make_plan
from megatron_rl.models.architecture import model_dims
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

REPO = Path(__file__).resolve().parents[2]
QWEN30B = json.loads((REPO / "examples" / "hf_configs" / "qwen3_30b_a3b.json").read_text())
LORA = ("model.lora.rank=32", "model.lora.targets=[attention,experts]", "model.options.layer_spec=local")
LOCAL = ("rollout.engine=local", "trainer.colocate=true")


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize(
    "lora",
    [LoRAOptions(rank=8), LoRAOptions(rank=8, targets=("attention",)), LoRAOptions(rank=8, share_expert_a=True)],
    ids=["all", "attention", "shared_expert_a"],
)
def test_adapter_count_equals_the_actors(tiny_moe_dir: Path, lora: LoRAOptions) -> None:
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.parallel_layout import ParallelLayout

    actor = MegatronActor.from_hf(tiny_moe_dir, ParallelLayout(), lora=lora)
    built = sum(p.numel() for chunk in actor.chunks for p in chunk.parameters() if p.requires_grad)
    dims = model_dims(json.loads((tiny_moe_dir / "config.json").read_text()))
    assert sum(lora_params(dims, lora, None)) == built


def test_a_shared_expert_a_is_priced_once_per_layer_and_expert_parallel_rank() -> None:
    layout = ("parallel.tp=1", "parallel.pp=1", "parallel.ep=2", "parallel.etp=1")
    each, shared = _plan(1, 2, *layout, *LORA), _plan(1, 2, *layout, *LORA, "model.lora.share_expert_a=true")
    d = model_dims(QWEN30B)
    # per MoE layer, the 64 experts of an EP rank hold one A for fc1 and one for fc2 instead of 64 of each
    saved = d.num_layers * (d.num_experts // 2 - 1) * 32 * (d.hidden_size + d.moe_ffn_hidden_size)
    assert each.params["lora"] - shared.params["lora"] == saved
    assert "LoRA: frozen base + 1462 MiB of adapters" in format_plan(shared)  # 2502 MiB with an A per expert


def _plan(nodes: int, gpus: int, *overrides: str):
    cfg = load_config(REPO / "examples" / "qwen3_30b_a3b_gspo_2x8xh100.yaml", [*LOCAL, *overrides])
    return make_plan(cfg, QWEN30B, ClusterSpec(nodes, gpus, 80))


def test_qwen3_30b_lora_fits_where_full_training_is_refused() -> None:
    layout = ("parallel.tp=1", "parallel.pp=1", "parallel.ep=2", "parallel.etp=1")
    with pytest.raises(PlanError, match="training needs"):
        _plan(1, 2, *layout)
    lora = _plan(1, 2, *layout, *LORA)
    full = _plan(1, 8, "parallel.tp=4", "parallel.ep=8", "parallel.etp=1")  # full training's smallest: one node
    assert lora.memory.grads < full.memory.grads / 5 and lora.memory.optimizer < full.memory.optimizer / 5
    assert "LoRA: frozen base + 2502 MiB of adapters" in format_plan(lora)


def test_kl_reference_with_lora_costs_no_host_memory() -> None:
    layout = ("parallel.tp=2", "parallel.ep=16", "parallel.etp=1", "algo.kl_coef=0.01", "trainer.offload_actor=false")
    full, lora = _plan(2, 8, *layout), _plan(2, 8, *layout, *LORA)
    assert "swapped from host memory" in format_plan(full)
    assert "KL reference: the base with LoRA adapters off (no copy, no host memory)" in lora.notes
    assert lora.memory.host_per_node == 0
