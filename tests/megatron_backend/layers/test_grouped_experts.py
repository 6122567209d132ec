"""The grouped experts (`model.options.experts=grouped`, megatron_backend/layers/grouped_experts.py) compute
what Megatron's `SequentialMLP` computes, with the same parameters and checkpoint layout.

Measured (CPU, torch 2.13, megatron-core 0.16.1): on the tiny Qwen3-MoE in fp32 and bf16, at TP=1, EP=2 and
TP=2 with expert TP 2, the logits and every parameter's gradient are bitwise equal (max |difference| 0). On the
tiny GPT-OSS (expert biases, clamped SwiGLU with offset and its own sigmoid gate) they agree to fp32 rounding: the
logits to 1.1e-6 (2.7e-7 of their scale), every gradient to 1.3e-6 of its scale (the gate's elementwise kernels
run over all tokens at once instead of per expert, and the biases' gradients are summed in another order). The
bounds below leave room for another CPU's kernels; a mistake in the grouping (a token in the wrong expert's
group, a dropped probability or bias) moves the logits by 1e-2 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.config.options import ModelOptions
from megatron_rl.megatron_backend.actor.model_builder import use_grouped_experts
from megatron_rl.parallel_layout import ParallelLayout
from tests.dist_harness import run_torchrun
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.megatron_backend.layers.scripts.grouped_experts_check import LAYOUTS, batches_for, compare_experts
from tests.models.tiny_gpt_oss import build_tiny_gpt_oss

SCRIPT = Path(__file__).parent / "scripts" / "grouped_experts_check.py"
# (logits relative to their max |value|, gradients relative to each gradient's max |value|)
TOL = {"fp32": (1e-6, 1e-5), "bf16": (2e-2, 5e-2)}


def _check(result: dict, dtype: str) -> None:
    logits_tol, grad_tol = TOL[dtype]
    assert result["grouped_class"] == ["GroupedSequentialMLP"]
    assert result["same_names"] and result["same_state_dict"] and result["same_sharded"] and result["same_grad_names"]
    assert result["logits"] <= logits_tol * result["logits_scale"], result
    assert result["grad_rel"] <= grad_tol, result
    assert result["calls_with_an_empty_expert"] > 0, result  # the [1, tp] batch: 2 routes, 8 experts


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grouped_equals_sequential_on_one_process(tiny_moe_dir: Path, megatron_world, dtype: str) -> None:  # noqa: F811
    vocab = json.loads((tiny_moe_dir / "config.json").read_text())["vocab_size"]
    result = compare_experts(tiny_moe_dir, ParallelLayout(), dtype, batches_for(0, 1, vocab))
    print(f"qwen3_moe {dtype}: {result}")
    _check(result, dtype)


def test_grouped_equals_sequential_with_biased_clamped_experts(
    tmp_path: Path,
    megatron_world,  # noqa: F811
) -> None:
    """GPT-OSS's experts (its own layer spec): biases, `glu_linear_offset`, `activation_func_clamp_value`."""
    model_dir = build_tiny_gpt_oss(tmp_path / "gpt_oss")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    result = compare_experts(model_dir, ParallelLayout(), "fp32", batches_for(1, 1, vocab))
    print(f"gpt_oss fp32: {result}")
    _check(result, "fp32")


@pytest.mark.torchrun
def test_grouped_equals_sequential_under_expert_and_tensor_parallelism(tiny_moe_dir: Path, tmp_path: Path) -> None:
    run_torchrun(SCRIPT, 2, [str(tiny_moe_dir), str(tmp_path)])
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == set(LAYOUTS)
        for layout, result in results.items():
            print(f"rank {rank} {layout}: {result}")
            _check({**result, "calls_with_an_empty_expert": 1}, "fp32")
    # Some local expert had no token on some rank in every layout (the [1, tp] batch has 2 * tp routes).
    for layout in LAYOUTS:
        assert any(
            json.loads((tmp_path / f"rank{r}.json").read_text())[layout]["calls_with_an_empty_expert"] for r in range(2)
        )


def test_unsupported_grouped_is_refused_naming_the_option_and_auto_falls_back(megatron_world) -> None:  # noqa: F811
    from megatron.core.transformer import TransformerConfig

    fused = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=32,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"model.options.experts=grouped is not supported with bias_activation_fusion"):
        use_grouped_experts(fused, ModelOptions(experts="grouped"), te=False)
    assert not use_grouped_experts(fused, ModelOptions(experts="auto"), te=False)
    with pytest.raises(ValueError, match=r"model.options.experts=grouped groups the local spec's experts"):
        use_grouped_experts(fused, ModelOptions(experts="grouped"), te=True)
    plain = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=32,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    )  # fmt: skip
    assert use_grouped_experts(plain, ModelOptions(experts="auto"), te=False)
    assert not use_grouped_experts(plain, ModelOptions(experts="auto"), te=True)  # the TE spec's experts stay
    assert not use_grouped_experts(plain, ModelOptions(experts="sequential"), te=False)


def _experts_pair(hidden: int, ffn: int, experts: int, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A `SequentialMLP` and a `GroupedSequentialMLP` with the same random SwiGLU weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_rl.megatron_backend.layers.grouped_experts import grouped_mlp_class

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=experts, moe_router_topk=2,
        moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, bias_activation_fusion=False,
        use_cpu_initialization=True,
    )  # fmt: skip
    groups = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(seed)
    sequential = SequentialMLP(experts, config, submodules, pg_collection=groups)
    grouped = grouped_mlp_class()(experts, config, submodules, pg_collection=groups)
    grouped.load_state_dict(sequential.state_dict())
    return sequential, grouped


def _forward_backward(module: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> dict:
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, _ = module(x, counts, probs)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "x": x.grad, **grads}


@pytest.mark.parametrize("gemm", ["grouped_mm", "loop", "auto"])
@pytest.mark.parametrize("hidden", [64, 6])
def test_both_computations_are_bitwise_sequential(megatron_world, gemm: str, hidden: int) -> None:  # noqa: F811
    """The grouped GEMM (one `grouped_mm` per projection, forward and backward) and the matmul loop, each forced,
    and the `auto` rule: outputs, the input's and every expert weight's gradient bitwise `SequentialMLP`'s, with
    an expert that gets no token (its weight gradients exactly 0). Hidden 6: rows of 24 bytes, not the 16-byte
    multiple the grouped GEMM requires (fc1's input, fc2's output), so `auto` takes the loop there."""
    from megatron_rl.megatron_backend.layers.grouped_experts import _grouped_mm_runs

    sequential, grouped = _experts_pair(hidden, 8, 4, seed=hidden)
    counts = torch.tensor([5, 0, 9, 2])
    gen = torch.Generator().manual_seed(0)
    x, probs = torch.randn(16, hidden, generator=gen), torch.rand(16, generator=gen)
    weights = [e.linear_fc1.weight for e in grouped.local_experts]
    assert _grouped_mm_runs(x, weights) is (hidden == 64)
    grouped.gemm = gemm
    if gemm == "grouped_mm" and hidden == 6:  # torch's grouped GEMM refuses these strides; `auto` never asks it
        with pytest.raises(RuntimeError, match="16 bytes"):
            _forward_backward(grouped, x, counts, probs)
        return
    expected, got = _forward_backward(sequential, x, counts, probs), _forward_backward(grouped, x, counts, probs)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert float(got["local_experts.1.linear_fc1.weight"].abs().max()) == 0.0
    assert float(got["local_experts.2.linear_fc2.weight"].abs().max()) > 0.0


def test_grouped_gemm_with_frozen_weights_and_the_cpu_stacking_limit(megatron_world) -> None:  # noqa: F811
    """Frozen expert weights: only the input's gradient, still bitwise. On CPU the grouped GEMM is taken while each
    expert's weight fits `CPU_EXPERT_MAX_BYTES` and one projection's stacked weights `CPU_STACK_MAX_BYTES`, the
    loop above either."""
    from megatron_rl.megatron_backend.layers import grouped_experts

    sequential, grouped = _experts_pair(64, 8, 4, seed=1)
    for module in (sequential, grouped):
        for p in module.parameters():
            p.requires_grad_(False)
    counts = torch.tensor([3, 4, 0, 9])
    x, probs = torch.randn(16, 64), torch.rand(16)
    grouped.gemm = "grouped_mm"
    expected, got = _forward_backward(sequential, x, counts, probs), _forward_backward(grouped, x, counts, probs)
    assert set(got) == {"out", "x"}
    assert torch.equal(got["out"], expected["out"]) and torch.equal(got["x"], expected["x"])
    weights = [torch.empty(32, 64) for _ in range(4)]  # 8 KiB each, 32 KiB stacked
    limits = grouped_experts.CPU_EXPERT_MAX_BYTES, grouped_experts.CPU_STACK_MAX_BYTES
    try:
        grouped_experts.CPU_EXPERT_MAX_BYTES, grouped_experts.CPU_STACK_MAX_BYTES = 8 << 10, 32 << 10
        assert grouped_experts._grouped_mm_runs(x, weights)
        grouped_experts.CPU_STACK_MAX_BYTES = (32 << 10) - 1
        assert not grouped_experts._grouped_mm_runs(x, weights)
        grouped_experts.CPU_EXPERT_MAX_BYTES, grouped_experts.CPU_STACK_MAX_BYTES = (8 << 10) - 1, 32 << 10
        assert not grouped_experts._grouped_mm_runs(x, weights)
    finally:
        grouped_experts.CPU_EXPERT_MAX_BYTES, grouped_experts.CPU_STACK_MAX_BYTES = limits
    # The rule at the benchmark's sizes: the demo's experts (16 KiB fc1) grouped, BENCH_SPEC's (256 KiB) looped.
    assert grouped_experts._grouped_mm_runs(x, [torch.empty(64, 64) for _ in range(8)])
    assert not grouped_experts._grouped_mm_runs(torch.randn(16, 256), [torch.empty(256, 256) for _ in range(16)])
