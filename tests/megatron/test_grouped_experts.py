"""The grouped experts (`model.options.experts=grouped`, models/grouped_experts.py) compute what Megatron's
`SequentialMLP` computes, with the same parameters and checkpoint layout.

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

from megatron_rl.megatron_backend.model_builder import use_grouped_experts
from megatron_rl.megatron_backend.options import ModelOptions
from megatron_rl.megatron_backend.parallel_layout import ParallelLayout
from tests.families.tiny_gpt_oss import build_tiny_gpt_oss
from tests.megatron.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.megatron.dist_harness import run_torchrun
from tests.megatron.scripts.grouped_experts_check import LAYOUTS, batches_for, compare_experts

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
