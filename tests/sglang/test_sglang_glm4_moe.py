"""A tiny GLM-4.5 on a REAL SGLang 0.5.23 server (CPU): SGLang builds the dense first layer as dense
(`Glm4MoeDecoderLayer._is_layer_sparse`: layer_id >= first_k_dense_replace), rotates the first half of each head
(`partial_rotary_factor` from `rope_parameters`), and routes with the score-correction bias and group-limited top-k
(`biased_grouped_topk_impl` on CPU: the top-2 group score transformers uses). Its samples' log-probs and the expert
sets at both MoE layers match transformers, and a weight update in HF names (the router's
`e_score_correction_bias` included) serves the new model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers
from tests.hf_reference import hf_score
from tests.models.tiny_glm4_moe import FULL, make_tiny_glm4_moe

pytestmark = pytest.mark.sglang

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 60, 70], [1, 99]]
TOL = 1e-4  # fp32 on both sides; measured ~5e-7


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_tiny_glm4_moe(tmp_path_factory.mktemp(f"sgl_glm_{name}"), FULL, seed=s)
        for s, name in enumerate("ab")
    }


@pytest.fixture(scope="module")
def engine(sglang_py: str, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    config = SGLangLaunchConfig(
        model_path=str(models["a"]),
        python=sglang_py,
        extra_args=CPU_SERVER_ARGS,
        env=cpu_launch_env(),
        log_dir=str(tmp_path_factory.mktemp("sglang_glm_logs")),
        startup_timeout_s=240,
    )
    with SGLangServers.launch(config) as servers:
        yield SGLangEngine(servers, request_timeout_s=60, control_timeout_s=30)


def test_samples_match_transformers_log_probs_and_expert_sets(engine: SGLangEngine, models: dict[str, Path]):
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=1.0, seed=1), n=2,
                              return_routed_experts=True)  # fmt: skip
    ref = hf_score(models["a"], [{"input_ids": s.tokens, "response_start": len(s.prompt_ids)} for s in samples])
    for s, r in zip(samples, ref, strict=True):
        assert s.routed_experts is not None and s.routed_experts.shape == (len(s.tokens) - 1, 2, 4)  # MoE layers 1, 2
        np.testing.assert_array_equal(np.sort(s.routed_experts, -1), np.sort(r["routed_experts"].numpy(), -1))
        err = (torch.tensor(s.response_log_probs, dtype=torch.float64) - r["log_probs"]).abs().max().item()
        assert err < TOL, err


def test_weight_update_in_hf_names_serves_the_new_model(engine: SGLangEngine, models: dict[str, Path]):
    probe = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    tensors = load_file(str(models["b"] / "model.safetensors"))
    assert any(n.endswith("e_score_correction_bias") for n in tensors)
    (want,) = hf_score(models["b"], [{"input_ids": probe, "response_start": 1}])

    def served() -> torch.Tensor:
        return torch.tensor(engine.score_prompts([probe])[0].log_probs[0], dtype=torch.float64)

    assert (served() - want["log_probs"]).abs().max() > 0.05
    engine.update_weights([list(tensors.items())], "b")
    assert (served() - want["log_probs"]).abs().max() < TOL
