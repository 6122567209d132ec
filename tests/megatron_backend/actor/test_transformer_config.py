"""Options that reach Megatron's TransformerConfig through `model_builder.transformer_config`."""

from __future__ import annotations

import pytest

from megatron_rl.config.options import ModelOptions
from megatron_rl.parallel_layout import ParallelLayout


@pytest.fixture(scope="module")
def bridged() -> None:
    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    platform.bridge_cpu()


@pytest.mark.usefixtures("bridged")
def test_expert_bias_is_frozen_unless_the_update_rate_is_set() -> None:
    """DeepSeek-V3's score-correction bias: Megatron's default rate (1e-3) would move routing on every RL update."""
    from transformers import AutoConfig

    from megatron_rl.megatron_backend.actor.model_builder import transformer_config

    deepseek = AutoConfig.for_model("deepseek_v3").to_dict()  # the 671B config; nothing is allocated
    frozen = transformer_config(deepseek, ParallelLayout(), ModelOptions())
    assert frozen.moe_router_enable_expert_bias and frozen.moe_router_bias_update_rate == 0.0
    moving = transformer_config(deepseek, ParallelLayout(), ModelOptions(expert_bias_update_rate=1e-3))
    assert moving.moe_router_bias_update_rate == 1e-3
    qwen = AutoConfig.for_model("qwen3_moe").to_dict()
    with pytest.raises(ValueError, match=r"expert_bias_update_rate=0.001: this qwen3_moe model's routers have no"):
        transformer_config(qwen, ParallelLayout(), ModelOptions(expert_bias_update_rate=1e-3))


@pytest.mark.usefixtures("bridged")
def test_biased_experts_need_expert_tensor_parallelism_1() -> None:
    """GPT-OSS: Megatron-Core supports expert biases only with expert TP 1; the error names parallel.etp."""
    from transformers import AutoConfig

    from megatron_rl.megatron_backend.actor.model_builder import transformer_config

    gpt_oss = AutoConfig.for_model("gpt_oss").to_dict()
    with pytest.raises(ValueError, match=r"experts have biases.*expert TP 2.*set parallel.etp=1"):
        transformer_config(gpt_oss, ParallelLayout(tp=2), ModelOptions())
    assert transformer_config(gpt_oss, ParallelLayout(tp=2, etp=1), ModelOptions()).expert_tensor_parallel_size == 1
