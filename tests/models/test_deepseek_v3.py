"""DeepSeek-V3 (Multi-Latent Attention, sigmoid router with score-correction bias and group-limited top-k) against
transformers at every layout, its conversion round trip, its routing replay, and the configurations it refuses.

Tolerance table (fp32, max |log-prob| / |entropy| error vs transformers 5.24; megatron-core 0.16.1 and 0.19.2 alike):
q_lora + YaRN:    tp1 1.5e-6, tp2_sp 1.8e-6, ep2 1.5e-6, pp2_uneven 1.5e-6, tp2_sp_ep2 2.0e-6;
no q_lora + RoPE + rms_norm_eps 1e-2: tp1 1.9e-6, tp2_sp 1.1e-6, ep2 1.9e-6, pp2_uneven 1.9e-6, tp2_sp_ep2 1.9e-6;
expert sets identical at every position and MoE layer; exports bitwise; layouts' first updates equal TP=1's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from megatron_rl.models import UnsupportedModelError, get_family
from tests.models.family_checks import TOL_HF, check_conversion_round_trip, check_family
from tests.models.mtp_layer import add_mtp_layer
from tests.models.tiny_deepseek_v3 import build_tiny_deepseek_v3

# The published configurations (config.json as on the Hub, FP8 quantization_config left out: a BF16 copy).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
MOONLIGHT = {
    **DEEPSEEK_V3, "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None,
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 8192,
}  # fmt: skip

KIMI_K2 = {
    **DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    return {
        "q_lora_yarn": build_tiny_deepseek_v3(root / "q_lora_yarn", q_lora_rank=24),
        "no_q_lora_rope": build_tiny_deepseek_v3(root / "no_q_lora_rope", q_lora_rank=None),
    }


@pytest.mark.torchrun
@pytest.mark.parametrize("variant", ["q_lora_yarn", "no_q_lora_rope"])
def test_matches_transformers_at_every_layout_and_trains_with_r2_and_r3(
    tiny_models: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    errors = check_family(tiny_models[variant], tmp_path)
    print(f"deepseek_v3 {variant}: max |log-prob / entropy error| per layout {errors}")
    assert set(errors) == {"tp1", "tp2_sp", "ep2", "pp2_uneven", "tp2_sp_ep2"}
    assert max(errors.values()) < TOL_HF


def test_conversion_round_trip_is_bitwise_and_keeps_the_mtp_layer(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with_mtp = add_mtp_layer(tiny_models["q_lora_yarn"], tmp_path / "with_mtp")
    family = get_family(json.loads((with_mtp / "config.json").read_text()))
    assert family.unused_tensor_reason(
        "model.layers.3.eh_proj.weight", {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    )
    assert (
        family.unused_tensor_reason(
            "model.layers.2.mlp.gate.weight", {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
        )
        is None
    )
    check_conversion_round_trip(with_mtp, tmp_path / "round_trip")


def _megatron_model(model_dir: Path):
    """The tiny model on one process with routing replay, weights loaded from the checkpoint."""
    from megatron_rl.config.options import ModelOptions
    from megatron_rl.megatron_backend.actor.model_builder import build_model
    from megatron_rl.megatron_backend.weights.hf_weights import load_hf_weights
    from megatron_rl.parallel_layout import ParallelLayout

    hf = json.loads((model_dir / "config.json").read_text())
    chunks, config = build_model(hf, ParallelLayout(), ModelOptions(routing_replay=True))
    load_hf_weights(chunks, model_dir, get_family(hf), hf)
    return chunks[0], config


@pytest.fixture(scope="module")
def megatron_world():
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    init_distributed(ParallelLayout(), seed=1234)
    yield
    shutdown()


def test_replay_replays_the_choice_and_gates_from_current_unbiased_scores(
    tiny_models: dict[str, Path], megatron_world: None
) -> None:
    """Replaying routes that the biased group-limited choice would never make: the routing map is exactly the
    replayed experts, and their gates are the current sigmoid scores (bias excluded), renormalised and scaled."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    model, _ = _megatron_model(tiny_models["q_lora_yarn"])
    router = model.decoder.layers[1].mlp.router
    assert router.expert_bias.abs().min() > 0  # the checkpoint's non-zero e_score_correction_bias
    tokens = torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(0))
    natural, _ = router(tokens)
    # Group 0 (experts 0-3) entirely: group-limited routing picks 2 of 4 groups, rarely all four from one.
    forced = torch.tensor([[0, 1, 2, 3]] * 6)
    RouterReplay.set_replay_data([forced] * len(RouterReplay.global_router_replay_instances))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        with torch.no_grad():
            probs, routing_map = router(tokens)
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, forced, True))
    scores = torch.sigmoid(tokens.view(6, 32) @ router.weight.detach().t()).gather(1, forced)
    expected = scores / scores.sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(probs.gather(1, forced), expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(natural.bool(), routing_map)


def test_expert_bias_is_frozen_during_training(tiny_models: dict[str, Path], megatron_world: None) -> None:
    """Megatron moves `expert_bias` by `moe_router_bias_update_rate` after each step from the tokens each expert
    received; the family sets the rate to 0 (an RL update must not change routing by itself)."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    model, config = _megatron_model(tiny_models["no_q_lora_rope"])
    assert config.moe_router_bias_update_rate == 0.0
    routers = [layer.mlp.router for layer in model.decoder.layers[1:]]  # layer 0 is dense
    before = [router.expert_bias.clone() for router in routers]
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, position_ids=torch.arange(16).expand(2, 16), attention_mask=None).sum().backward()
    assert all(router.local_tokens_per_expert.sum() > 0 for router in routers)
    _update_router_expert_bias([model], config)
    assert all(torch.equal(router.expert_bias, b) for router, b in zip(routers, before, strict=True))
    moved = copy.copy(config)
    moved.moe_router_bias_update_rate = 1e-3  # Megatron's default would move it
    model(input_ids=ids, position_ids=torch.arange(16).expand(2, 16), attention_mask=None).sum().backward()
    _update_router_expert_bias([model], moved)
    assert not torch.equal(routers[0].expert_bias, before[0])


def test_published_configurations_translate() -> None:
    v3 = get_family(DEEPSEEK_V3).transformer_config_kwargs(DEEPSEEK_V3)
    assert (v3["rope_type"], v3["rotary_scaling_factor"], v3["mscale"], v3["mscale_all_dim"]) == ("yarn", 40, 1, 1)
    assert (v3["moe_router_num_groups"], v3["moe_router_group_topk"], v3["q_lora_rank"]) == (8, 4, 1536)
    assert v3["moe_layer_freq"] == [0] * 3 + [1] * 58
    moon = get_family(MOONLIGHT).transformer_config_kwargs(MOONLIGHT)
    assert (moon["rope_type"], moon["rotary_base"], moon["q_lora_rank"]) == ("rope", 50000.0, None)
    assert "moe_router_num_groups" not in moon  # n_group=1: every expert can be chosen
    assert moon["moe_shared_expert_intermediate_size"] == 2 * 1408 and not moon["moe_shared_expert_gate"]
    kimi = get_family(KIMI_K2).transformer_config_kwargs(KIMI_K2)
    assert (kimi["rotary_scaling_factor"], kimi["beta_fast"], kimi["beta_slow"], kimi["rotary_base"]) == (32, 1, 1, 5e4)
    assert kimi["num_moe_experts"] == 384 and kimi["moe_router_topk_scaling_factor"] == 2.827
    assert "moe_router_num_groups" not in kimi


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=false with a sigmoid router"),
        ({"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}, "num_experts_per_tok=1 and norm_topk_prob=true"),
        ({"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "type": "longrope"}}, "RoPE type 'longrope'"),
        ({"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "attention_factor": 1.2}}, "YaRN settings"),
        ({"num_experts_per_tok": 6}, r"num_experts_per_tok // topk_group = 1"),
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"num_key_value_heads": 16}, "num_key_value_heads=16"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"does not translate: \['quantization_config'\]"),
    ],
)
def test_refuses_what_megatron_would_compute_differently(change: dict, match: str) -> None:
    config = {**DEEPSEEK_V3, **change}
    with pytest.raises(UnsupportedModelError, match=match):
        get_family(config).transformer_config_kwargs(config)


def test_the_671b_example_plan_holds_its_header_numbers() -> None:
    """examples/deepseek_v3_671b_gspo.yaml on 20 nodes of 8x B200: 671 B parameters, 37.6 B active; SGLang's MLA
    cache 61 layers x (512 + 64) x 2 B per token on every GPU, ~197k tokens per server."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.launch.plan import ClusterSpec, make_plan

    repo = Path(__file__).resolve().parents[2]
    hf = json.loads((repo / "examples" / "hf_configs" / "deepseek_v3.json").read_text())
    plan = make_plan(load_config(repo / "examples" / "deepseek_v3_671b_gspo.yaml"), hf, ClusterSpec(20, 8, 178, 4))
    assert round(plan.params["total"] / 1e9, 1) == 671.0 and round(plan.params["active"] / 1e9, 1) == 37.6
    assert plan.layout.stage_layers == (16, 15, 15, 15)
    assert plan.memory.sglang_kv_token_bytes == 61 * (512 + 64) * 2
    assert round(plan.memory.sglang_kv_tokens / 1e3) == 197


def test_te_spec_refuses_what_its_fused_latent_norms_compute_differently() -> None:
    """The TE spec fuses the latent norms into the up projections with rms_norm_eps (transformers: 1e-6), and
    megatron-core 0.19 resolves a Q norm into a fused linear_q_proj when q_lora_rank is None (Moonlight), which HF
    does not have: both refused for the TE spec (the local spec is exact)."""
    from types import SimpleNamespace

    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_rl.megatron_backend.layers.mla import mla_block_spec as mla_layer_spec

    moonlight_eps = SimpleNamespace(q_lora_rank=1536, layernorm_epsilon=1e-5)
    with pytest.raises(UnsupportedModelError, match=r"rms_norm_eps=1e-05 with the Transformer Engine spec"):
        mla_layer_spec(moonlight_eps, True, None)
    if hasattr(MLASelfAttention, "_resolve_qk_norm_config"):  # 0.19.x
        with pytest.raises(UnsupportedModelError, match="q_lora_rank=None with the Transformer Engine spec"):
            mla_layer_spec(SimpleNamespace(q_lora_rank=None, layernorm_epsilon=1e-6), True, None)


@pytest.mark.parametrize("variant", ["q_lora_yarn", "no_q_lora_rope"])
def test_planner_counts_mla_parameters_and_its_compressed_kv_cache(tiny_models: dict[str, Path], variant: str) -> None:
    """The launch planner's parameter count equals transformers' own model; SGLang's MLA cache holds
    kv_lora_rank + qk_rope_head_dim values per token and layer on every GPU, whatever the server's tp."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.config.loader import load_config
    from megatron_rl.launch.plan import ClusterSpec, kv_cache_token_bytes, make_plan
    from megatron_rl.models.architecture import model_dims

    hf = json.loads((tiny_models[variant] / "config.json").read_text())
    repo = Path(__file__).resolve().parents[2]
    plan = make_plan(load_config(repo / "examples" / "tiny_moe_gspo.yaml"), hf, ClusterSpec(1, 1, 80))
    model = AutoModelForCausalLM.from_pretrained(tiny_models[variant])
    assert plan.params["total"] == sum(p.numel() for p in model.parameters())
    assert plan.params["experts"] == 2 * 16 * 3 * 32 * 16  # two MoE layers of 16 experts
    dims = model_dims(hf)
    assert kv_cache_token_bytes(dims, server_tp=1) == kv_cache_token_bytes(dims, server_tp=8) == 3 * (16 + 8) * 2
