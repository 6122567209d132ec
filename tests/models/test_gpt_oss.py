"""GPT-OSS (`gpt_oss`): parity with transformers at every layout, bitwise export and conversion, RL updates with R2
and R3, the fused expert mappings' orientation, YaRN's translation and the refusals.

Measured (fp32, tiny model below, 4 samples of 8-29 tokens, sliding window 8; identical on megatron-core 0.16.1 and
0.19.2), max abs error vs transformers; expert sets identical at every position and layer, export bitwise:

    layout        log-prob   entropy
    tp1           1.1e-6     4.8e-7
    ep2           1.1e-6     5.2e-7
    pp2_uneven    1.1e-6     5.2e-7
    tp2_sp_ep2    1.2e-6     5.3e-7
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_rl.models import UnsupportedModelError, get_family
from megatron_rl.models.gpt_oss import (
    InterleavedGLUMapping,
    TransposedMapping,
    config_attributes,
    transformer_config_kwargs,
)
from tests.hf_reference import hf_score
from tests.models.family_checks import LAYOUTS_2, TOL_HF, check_conversion_round_trip, check_family
from tests.models.tiny_gpt_oss import SLIDING_WINDOW, build_tiny_gpt_oss, tiny_gpt_oss_config

# Megatron-Core refuses biases in experts split over tensor-parallel ranks ("Bias in Moe is only supported when
# ETP==1", transformer_config.py), so TP=2+SP is checked with expert TP 1 together with EP=2 (tp2_sp_ep2). TP=2 with
# expert TP 1 and no EP is left out: there megatron-core 0.16.1's first-update gradient norm differs from TP=1's
# (GPT-OSS 8e-4 relative, Qwen3-MoE 2e-4: not the family's), while 0.19.2 matches; its log-probs match either way.
LAYOUTS = [layout for layout in LAYOUTS_2 if layout["name"] != "tp2_sp"]

# openai/gpt-oss-20b's config.json (the published MXFP4 checkpoint), as written by transformers 4.55.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip
DEQUANTISED_20B = {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "hf")


@pytest.mark.torchrun
def test_layouts_match_transformers(tiny: Path, tmp_path: Path) -> None:
    errors = check_family(tiny, tmp_path, LAYOUTS)
    print("gpt_oss max abs log-prob/entropy error vs transformers:", errors)
    assert set(errors) == {"tp1", *(layout["name"] for layout in LAYOUTS)}


def test_local_engine_generation_scores_like_a_full_forward(tiny: Path) -> None:
    """The local engine (transformers' KV cache, prompts of different lengths batched, responses past the sliding
    window) gives each token the log-prob and experts a full forward of the finished sequence gives: the R3 routes
    the trainer replays come from the family's recorder on `mlp.router`."""
    from megatron_rl.config.sampling import SamplingParams
    from megatron_rl.rollout.engines.local_engine import LocalEngine

    engine = LocalEngine(tiny, stop_on_eos=False)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22]]
    params = SamplingParams(max_new_tokens=14, temperature=1.0, seed=3)
    out = engine.generate(prompts, params, n=2, return_routed_experts=True)
    samples = [{"input_ids": s.prompt_ids + s.response_ids, "response_start": len(s.prompt_ids)} for s in out]
    assert max(len(s["input_ids"]) for s in samples) > 2 * SLIDING_WINDOW
    for sample, ref in zip(out, hf_score(tiny, samples), strict=True):
        log_probs = torch.tensor(sample.response_log_probs, dtype=torch.float64)
        assert (log_probs - ref["log_probs"]).abs().max() < TOL_HF
        routes = torch.from_numpy(sample.routed_experts).long()
        assert torch.equal(routes.sort(-1).values, ref["routed_experts"].long().sort(-1).values)


def test_conversion_round_trip_is_bitwise(tiny: Path, tmp_path: Path) -> None:
    check_conversion_round_trip(tiny, tmp_path)


def test_fused_expert_mappings_follow_transformers_math() -> None:
    """One expert through HF's fused tensors (GptOssExperts: x @ gate_up_proj[e], gate = even columns) and through
    Megatron's fc1/fc2 built by the mappings (x @ fc1.T = [gate | up], Megatron's clamped GLU with offset 1) agree,
    and the mappings invert exactly."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    config = tiny_gpt_oss_config()
    experts = GptOssExperts(config)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    fc1_map, fc1_bias_map = InterleavedGLUMapping("fc1", ("gate_up_proj",)), InterleavedGLUMapping("b", ("b",))
    fc2_map = TransposedMapping("fc2", ("down_proj",))
    e, x = 3, torch.randn(5, config.hidden_size)
    fc1 = fc1_map.to_megatron([experts.gate_up_proj[e]])
    fc1_bias = fc1_bias_map.to_megatron([experts.gate_up_proj_bias[e]])
    fc2 = fc2_map.to_megatron([experts.down_proj[e]])
    assert fc1.shape == (2 * config.intermediate_size, config.hidden_size)
    assert fc2.shape == (config.hidden_size, config.intermediate_size)

    gate, up = (x @ fc1.T + fc1_bias).chunk(2, dim=-1)  # Megatron's MLP: glu() in transformer/mlp.py
    gate, up = gate.clamp(max=config.swiglu_limit), up.clamp(-config.swiglu_limit, config.swiglu_limit)
    megatron = (gate * torch.sigmoid(config.swiglu_alpha * gate) * (up + 1.0)) @ fc2.T + experts.down_proj_bias[e]
    with torch.no_grad():
        hf = experts._apply_gate(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
        hf = hf @ experts.down_proj[e] + experts.down_proj_bias[e]
    torch.testing.assert_close(megatron, hf, rtol=0, atol=1e-6)
    assert torch.equal(fc1_map.to_hf(fc1)[0], experts.gate_up_proj[e])
    assert torch.equal(fc1_bias_map.to_hf(fc1_bias)[0], experts.gate_up_proj_bias[e])
    assert torch.equal(fc2_map.to_hf(fc2)[0], experts.down_proj[e])


def test_gpt_oss_20b_config_translates_to_megatron() -> None:
    """The published 20B config (rope_scaling + top-level rope_theta, experts_per_token) after dequantisation:
    every field is translated, YaRN gives Megatron's rotary frequencies and scale equal to transformers'."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    family = get_family(DEQUANTISED_20B)
    kwargs = transformer_config_kwargs(DEQUANTISED_20B)
    assert kwargs["window_size"] == (127, 0)
    assert kwargs["window_attn_skip_freq"] == [1, 0] * 12
    assert kwargs["activation_func_clamp_value"] == 7.0 and kwargs["glu_linear_offset"] == 1.0
    assert kwargs["activation_func"].keywords == {"alpha": 1.702}
    assert kwargs["softmax_type"] == "learnable" and kwargs["add_bias_linear"]
    assert family.gpt_model_kwargs(DEQUANTISED_20B)["rotary_base"] == 150000.0

    yarn = config_attributes(DEQUANTISED_20B)
    assert yarn["yarn_correction_range_round_to_int"] is False and yarn["yarn_mscale"] is None
    rope = YarnRotaryEmbedding(
        kv_channels=64,
        rotary_base=150000.0,
        scaling_factor=yarn["yarn_rotary_scaling_factor"],
        original_max_position_embeddings=yarn["yarn_original_max_position_embeddings"],
        beta_fast=yarn["yarn_beta_fast"],
        beta_slow=yarn["yarn_beta_slow"],
        mscale=yarn["yarn_mscale"],
        mscale_all_dim=yarn["yarn_mscale_all_dim"],
        correction_range_round_to_int=yarn["yarn_correction_range_round_to_int"],
        use_cpu_initialization=True,
    )
    emb, mscale = rope.get_emb(2)
    hf_config = GptOssConfig(**{k: v for k, v in DEQUANTISED_20B.items() if k not in ("architectures",)})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    assert torch.equal(emb[1, 0, 0, :32], inv_freq)  # position 1: the frequencies themselves
    assert math.isclose(mscale, attention_factor, rel_tol=0, abs_tol=1e-15)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"quantization_config": GPT_OSS_20B["quantization_config"]}, r"quant_method='mxfp4'.*Mxfp4Config\(dequant"),
        ({"attention_bias": False}, r"attention_bias=false"),
        ({"experts_per_token": 2}, r"experts_per_token=2 != num_experts_per_tok=4"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 12}, r"layer_types must list 24 entries of"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"rope_type='linear'"),
        ({"rope_scaling": None}, r"neither rope_parameters nor rope_scaling"),
        ({"rope_scaling": {**GPT_OSS_20B["rope_scaling"], "attention_factor": 1.5}}, r"explicit attention_factor"),
    ],
)
def test_unsupported_values_are_refused_with_the_fix(change: dict, match: str) -> None:
    config = {**DEQUANTISED_20B, **change}
    with pytest.raises(UnsupportedModelError, match=match):
        get_family(config).dims(config)


def test_unknown_fields_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match=r"does not translate: \['attn_logit_softcapping'\]"):
        get_family({**DEQUANTISED_20B, "attn_logit_softcapping": 30.0})
