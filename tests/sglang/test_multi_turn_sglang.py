"""Multi-turn rollouts through a REAL SGLang server (CPU, fp32): every turn is a new request whose prefix SGLang
serves from its radix cache; the trajectory's R3 routes must still be those of every position of the final
sequence, and its per-turn log-probs those of the final sequence scored in one pass (P16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env

from megatron_rl.config.sampling import SamplingParams, TurnLimits
from megatron_rl.rollout.agent.env import StepResult
from megatron_rl.rollout.agent.multi_turn import generate_with_envs
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers
from megatron_rl.tiny_model import build_char_tokenizer, make_tiny_qwen3_moe

pytestmark = pytest.mark.sglang


class Echo:
    def reset(self, prompt: Prompt) -> list[int]:
        return prompt.token_ids

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        return StepResult("|obs|")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("multi_turn_sglang") / "model", seed=3)


def test_multi_turn_routes_and_log_probs_through_the_radix_cache(
    sglang_py: str, model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    prompts = [Prompt("a", [10, 11, 12, 13]), Prompt("b", [20, 21]), Prompt("c", [30, 31, 32])]
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=4, stop_token_ids=tuple(range(64, 128)))
    config = SGLangLaunchConfig(
        model_path=str(model_dir),
        python=sglang_py,
        extra_args=CPU_SERVER_ARGS,
        env=cpu_launch_env(),
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=240,
    )
    with SGLangServers.launch(config) as servers:
        engine = SGLangEngine(servers, request_timeout_s=120, control_timeout_s=30)
        trajectories = generate_with_envs(
            engine,
            [Echo() for _ in prompts],
            prompts,
            params,
            tokenizer,
            TurnLimits(3, 200),
            return_routed_experts=True,
        )
        engine.flush_cache()  # the reference: each final sequence prefilled at once, nothing from the cache
        fresh = engine.generate([t.tokens for t in trajectories], SamplingParams(max_new_tokens=1, temperature=0.0),
                                return_routed_experts=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    agree = total = 0
    for t, ref in zip(trajectories, fresh, strict=True):
        assert len(t.turns) == 3 and t.routed_experts is not None
        n = len(t.tokens) - 1
        assert t.routed_experts.shape == (n, 2, 2) and ref.routed_experts is not None
        # Same expert sets at (nearly) every position: the cached prefix kept its routes, aligned to the sequence.
        same = np.sort(t.routed_experts, -1) == np.sort(ref.routed_experts[:n], -1)
        agree, total = agree + int(same.all(-1).sum()), total + same.shape[0] * same.shape[1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([t.tokens[:-1]])).logits[0, t.response_start - 1 :].float()
        scored = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0].numpy()
        mask = np.array(t.loss_mask, dtype=bool)
        np.testing.assert_allclose(np.array(t.response_log_probs)[mask], scored[mask], atol=2e-3, rtol=0)
    assert agree / total > 0.99, f"routes of the multi-turn sequences agree with a fresh prefill at {agree / total:.4f}"
