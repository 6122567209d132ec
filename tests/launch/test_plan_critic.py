"""The launch planner prices the critic (`algo.advantage: gae`): a second model of the policy's architecture in the
actor's layout whose parameter count is the built `MegatronCritic`'s, adding its weights, gradients and optimizer
state (not its activations) to the memory line, which names it; Qwen3-30B-A3B's 2-node example fits without it and
is refused with it, and fits again on 4 nodes. (The per-rank count under EP, PP and TP: the critic layout test.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.launch.critic_memory import critic_params
from megatron_rl.launch.model_memory import shared_expert_gate
from megatron_rl.launch.plan import ClusterSpec, PlanError, format_plan, make_plan
from megatron_rl.models.architecture import model_dims
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

REPO = Path(__file__).resolve().parents[2]
QWEN30B = json.loads((REPO / "examples" / "hf_configs" / "qwen3_30b_a3b.json").read_text())
GAE = "algo.advantage=gae"


def _plan(example: str, nodes: int, *overrides: str):
    return make_plan(load_config(REPO / "examples" / example, list(overrides)), QWEN30B, ClusterSpec(nodes, 8, 80))


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_critic_count_equals_the_built_critics(tiny_moe_dir: Path, tiny_moe_variants: dict[str, Path], tied: bool):
    """The untied model's critic is the actor less the vocabulary projection plus the value head; the tied one's
    gains the head (its embedding stays its own)."""
    from megatron_rl.megatron_backend.critic.value_model import MegatronCritic
    from megatron_rl.parallel_layout import ParallelLayout

    model = tiny_moe_variants["tied_no_norm_topk"] if tied else tiny_moe_dir
    critic = MegatronCritic.from_hf(model, ParallelLayout())
    built = sum(p.numel() for chunk in critic.chunks for p in chunk.parameters())
    hf = json.loads((model / "config.json").read_text())
    dims = model_dims(hf)
    assert sum(critic_params(dims, shared_expert_gate(hf, dims), None)) == built
    plan = make_plan(load_config(REPO / "examples" / "tiny_moe_gspo.yaml", [GAE]), hf, ClusterSpec(1, 1, 80))
    h, lm_head = dims.hidden_size, 0 if tied else dims.vocab_size * dims.hidden_size
    assert built == plan.params["total"] - lm_head + h == plan.params["critic"]


def test_the_critic_adds_its_weights_grads_and_optimizer_state() -> None:
    """Qwen3-30B-A3B at tp=2, ep=32, etp=1 on 32 GPUs (bf16, distributed optimizer: dp=16, expert-dp=1), by hand:
    each GPU holds the critic's share of the layers, its embedding and the value head, 2 + 4 B per parameter of
    weights and gradients and 12 B of Adam state per parameter of its optimizer shard; the actor's terms stay."""
    args = ("qwen3_30b_a3b_gspo_2x8xh100.yaml", 4, "parallel.ep=32")
    grpo, gae = _plan(*args), _plan(*args, GAE)
    h, layers, experts, inter, vocab = 2048, 48, 128, 768, 151936
    attention = 2 * h * 32 * 128 + 2 * h * 4 * 128 + 2 * 128 + 2 * h
    dense = layers * (attention + experts * h) / 2 + vocab * h / 2 + 2 * h  # embedding on tp=2, norm + head whole
    expert = layers * experts * 3 * h * inter / 32
    critic = (dense + expert) * (2 + 4) + (dense / 16 + expert) * 12
    assert gae.params["critic"] == pytest.approx(dense + expert)
    assert gae.memory.critic == pytest.approx(critic) and round(critic / 2**30, 1) == 19.1
    for term in ("weights", "grads", "optimizer", "activations", "logits", "host_optimizer"):
        assert getattr(gae.memory, term) == getattr(grpo.memory, term), term
    assert gae.memory.total == pytest.approx(grpo.memory.total + 1.1 * critic)  # 29.2 -> 50.2 GiB
    assert gae.memory.host_per_node == pytest.approx(grpo.memory.host_per_node + 8 * critic)  # parked with the actor
    assert "+ logits 3.5 + critic 19.1 (weights, grads, optimizer) = 50.2 GiB of 75.0 GiB" in format_plan(gae)
    assert "critic" not in format_plan(grpo)
    note = "critic (algo.advantage=gae): a second model in the actor's layout, 19.1 GiB per GPU"
    assert any(n.startswith(note) for n in gae.notes)
    named = _plan(*args, GAE, "algo.critic.hf_path=/ckpt/reward_model")
    assert any("algo.critic.hf_path is priced as the policy's architecture" in n for n in named.notes)


def test_a_plan_that_fits_without_the_critic_needs_more_gpus_with_it() -> None:
    example = "qwen3_30b_a3b_gspo_2x8xh100.yaml"
    assert _plan(example, 2).memory.total / 2**30 == pytest.approx(46.5, abs=0.05)
    with pytest.raises(PlanError, match=r"training needs ~84.6 GiB per GPU but 75.0 GiB are available") as err:
        _plan(example, 2, GAE)
    assert "+ critic 34.7 (weights, grads, optimizer)" in str(err.value)
    assert _plan(example, 4, "parallel.ep=32", GAE).memory.total <= 75 * 2**30


def test_the_critics_offloaded_optimizer_state_is_in_host_memory_and_crosses_pcie() -> None:
    """The 1-node example offloads the optimizer to the host (16 B per parameter of the shard, 8 B over PCIe per
    update): the critic's shard does the same, and only its weights and gradients stay on the GPU."""
    example = "qwen3_30b_a3b_gspo_8xh100.yaml"
    grpo, gae = _plan(example, 1), _plan(example, 1, GAE)
    d = model_dims(QWEN30B)
    dense, expert = critic_params(d, False, gae.layout)
    shard = dense / gae.layout.dp + expert / gae.layout.expert_dp
    assert gae.memory.critic == pytest.approx((dense + expert) * (2 + 4))
    assert gae.memory.host_optimizer - grpo.memory.host_optimizer == pytest.approx(shard * 16)
    updates = 4  # mini-batches per step x PPO epochs
    assert gae.memory.pcie_seconds_per_step - grpo.memory.pcie_seconds_per_step == pytest.approx(
        updates * shard * 8 / 25e9
    )
