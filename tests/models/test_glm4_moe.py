"""GLM-4.5 family (`glm4_moe`): parity with transformers at every layout, export and conversion bitwise, RL
updates with R2/R3 replay, the router's expert bias carried and frozen, and refusals of what Megatron would compute
differently. Tiny models: tests/models/tiny_glm4_moe.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.megatron_backend.weights.hf_weights import SafetensorsIndex
from megatron_rl.models import UnsupportedModelError, get_family
from megatron_rl.models.architecture import model_dims
from tests.models.family_checks import check_conversion_round_trip, check_family
from tests.models.mtp_layer import add_mtp_layer
from tests.models.tiny_glm4_moe import AIR_LIKE, FULL, make_tiny_glm4_moe

# GLM-4.5-Air's config.json (zai-org/GLM-4.5-Air), as transformers 4.54 wrote it.
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}  # fmt: skip


@pytest.fixture(scope="module")
def full_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm4_moe(tmp_path_factory.mktemp("glm_full"), FULL)


@pytest.fixture(scope="module")
def air_like_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm4_moe(tmp_path_factory.mktemp("glm_air"), AIR_LIKE)


def test_dims_and_megatron_options_of_glm45_air() -> None:
    family = get_family(GLM45_AIR)
    dims = family.dims(GLM45_AIR)
    assert dims.moe_layers == list(range(1, 46)) and dims.ffn_hidden_size == 10944
    assert (dims.num_experts, dims.top_k, dims.moe_ffn_hidden_size, dims.shared_expert_ffn_hidden_size) == (
        128, 8, 1408, 1408,
    )  # fmt: skip
    assert (dims.head_dim, dims.qkv_bias, dims.qk_layernorm) == (128, True, False)
    config = family.transformer_config_kwargs(GLM45_AIR)
    assert config["moe_router_score_function"] == "sigmoid" and config["moe_router_enable_expert_bias"]
    assert "moe_router_num_groups" not in config and "moe_router_group_topk" not in config  # one group
    assert config["moe_shared_expert_gate"] is False and config["moe_layer_freq"][:2] == [0, 1]
    assert family.gpt_model_kwargs(GLM45_AIR)["rotary_percent"] == 0.5
    mtp = "model.layers.46.mlp.experts.3.up_proj.weight"
    assert family.unused_tensor_reason(mtp, GLM45_AIR) is not None  # the MTP layer
    assert family.unused_tensor_reason("model.layers.46.eh_proj.weight", GLM45_AIR) is not None
    assert family.unused_tensor_reason("model.layers.45.mlp.experts.3.up_proj.weight", GLM45_AIR) is None
    assert family.unused_tensor_reason(mtp, {**GLM45_AIR, "num_nextn_predict_layers": 0}) is None


def test_partial_rotary_factor_defaults_to_transformers_value() -> None:
    no_factor = {k: v for k, v in GLM45_AIR.items() if k != "partial_rotary_factor"}
    assert get_family(no_factor).gpt_model_kwargs(no_factor)["rotary_percent"] == 0.5
    v5 = {**no_factor, "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25, "rope_type": "default"}}
    assert get_family(v5).gpt_model_kwargs(v5)["rotary_percent"] == 0.25


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"norm_topk_prob": False}, r"norm_topk_prob=false with a sigmoid router: Megatron's sigmoid routing always"),
        ({"num_experts_per_tok": 1}, r"num_experts_per_tok=1 and norm_topk_prob=true is not supported"),
        ({"n_group": 4, "topk_group": 2}, r"num_experts_per_tok=8 and topk_group=2: transformers scores a group by"),
        ({"n_group": 3}, r"n_routed_experts=128 does not split into n_group=3 groups"),
        ({"n_shared_experts": 0}, r"n_shared_experts=0 is not supported"),
        ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor=0.0 and head_dim=128 rotates 0 dims"),
        ({"head_dim": 18, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 and head_dim=18 rotates 9 dims"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"RoPE scaling type 'yarn' is not supported"),
    ],
)  # fmt: skip
def test_unsupported_values_are_refused_by_name(change: dict, message: str) -> None:
    config = {**GLM45_AIR, **change}
    family = get_family(config)
    with pytest.raises(UnsupportedModelError, match=message):
        family.dims(config)
        family.gpt_model_kwargs(config)


def test_unknown_field_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match=r"does not translate: \['scoring_func'\]"):
        get_family({**GLM45_AIR, "scoring_func": "softmax"})


def _dims_of(model_dir: Path):
    return model_dims(json.loads((model_dir / "config.json").read_text()))


@pytest.mark.torchrun
def test_full_model_matches_transformers_at_every_layout(full_model: Path, tmp_path: Path) -> None:
    assert _dims_of(full_model).moe_layers == [1, 2]
    errors = check_family(full_model, tmp_path)
    print("glm4_moe FULL max |log-prob/entropy error| per layout:", errors)


@pytest.mark.torchrun
def test_air_like_model_matches_transformers_at_every_layout(air_like_model: Path, tmp_path: Path) -> None:
    errors = check_family(air_like_model, tmp_path)
    print("glm4_moe AIR_LIKE max |log-prob/entropy error| per layout:", errors)


def test_conversion_round_trip_is_bitwise_and_keeps_the_mtp_layer(tmp_path: Path) -> None:
    """Every tensor back bitwise: the router's expert bias (a buffer) and the MTP layer the model does not build."""
    model_dir = add_mtp_layer(make_tiny_glm4_moe(tmp_path / "plain", FULL), tmp_path / "with_mtp")
    assert any(".layers.3." in n for n in SafetensorsIndex(model_dir).names())
    check_conversion_round_trip(model_dir, tmp_path)


def test_rl_updates_keep_the_checkpoints_expert_bias(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Two updates move the router but not `e_score_correction_bias` (Megatron's expert_bias, a buffer the optimizer
    never sees, which `finalize_model_grads` moves by moe_router_bias_update_rate): the export after training still
    carries the checkpoint's bias bitwise; with model.options.expert_bias_update_rate=1e-3 it moves by 1e-3 a step.
    The checkpoint's MTP layer is skipped by name on load."""
    import torch

    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    model_dir = add_mtp_layer(make_tiny_glm4_moe(tmp_path / "plain", AIR_LIKE), tmp_path / "with_mtp")
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = TokenBatch(ids, torch.tensor([12, 12]), torch.tensor([4, 4]))

    def loss_fn(logp, ent, mb):
        mask = mb.response_mask().to(logp.device).float()
        return -(logp * mask).sum(), mask.sum().to(torch.int), {}

    layout = ParallelLayout()
    init_distributed(layout, seed=3)
    dynamo_disabled, torch._dynamo.config.disable = torch._dynamo.config.disable, True  # no CPU compiles
    exported = {}
    try:
        for rate in (0.0, 1e-3):
            actor = MegatronActor.from_hf(
                model_dir,
                layout,
                model_options=ModelOptions(dispatcher="alltoall", expert_bias_update_rate=rate),
                optimizer_options=OptimizerOptions(lr=1e-2),
                micro_batch_tokens=64,
            )
            for _ in range(2):
                actor.train_step(batch, loss_fn)
            exported[rate] = {n: t for bucket in actor.export_hf() for n, t in bucket}
            del actor
    finally:
        torch._dynamo.config.disable = dynamo_disabled
        shutdown()
    checkpoint = SafetensorsIndex(model_dir)
    mtp = sum(n.startswith("model.layers.3.") for n in checkpoint.names())
    assert f"skipped {mtp} checkpoint tensors (multi-token prediction layer" in capfd.readouterr().err
    for layer in (1, 2):
        h = f"model.layers.{layer}.mlp.gate."
        bias = checkpoint.get(h + "e_score_correction_bias")
        assert torch.equal(exported[0.0][h + "e_score_correction_bias"], bias)
        assert not torch.equal(exported[0.0][h + "weight"], checkpoint.get(h + "weight")), "the router did not train"
        # each step moves each expert's bias by -1e-3, 0 or +1e-3 (the sign of its load deficit)
        steps = (exported[1e-3][h + "e_score_correction_bias"] - bias) / 1e-3
        assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.round().abs().max() == 2, steps


def test_planner_counts_glm_parameters(full_model: Path) -> None:
    """The launch planner's parameter count equals transformers' own model (partial RoPE, QKV biases, QK-norm, two
    shared experts, a dense first layer)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.config.loader import load_config
    from megatron_rl.launch.plan import ClusterSpec, make_plan

    repo = Path(__file__).resolve().parents[2]
    tiny = json.loads((full_model / "config.json").read_text())
    plan = make_plan(load_config(repo / "examples" / "tiny_moe_gspo.yaml"), tiny, ClusterSpec(1, 1, 80))
    model = AutoModelForCausalLM.from_pretrained(full_model)
    assert plan.params["total"] == sum(p.numel() for p in model.parameters())


def test_the_air_example_plan_holds_its_header_numbers() -> None:
    """examples/glm45_air_gspo.yaml on 4 nodes of 8x H200 plans what its header says: 106.85 B parameters (99.66 B
    in experts, 13.42 B active), 92.6 GiB per GPU of 136 (the dense first layer counted once, not per layer),
    23.0 KiB of KV cache per token and GPU (46 layers x K,V x 1 KV head x 128 x 2 B)."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.launch.plan import ClusterSpec, make_plan

    repo = Path(__file__).resolve().parents[2]
    air = json.loads((repo / "examples" / "hf_configs" / "glm45_air.json").read_text())
    assert air == GLM45_AIR
    plan = make_plan(load_config(repo / "examples" / "glm45_air_gspo.yaml"), air, ClusterSpec(4, 8, 141))
    assert [round(plan.params[k] / 1e9, 2) for k in ("total", "experts", "active")] == [106.85, 99.66, 13.42]
    assert round(plan.memory.total / 2**30, 1) == 92.6 and round(plan.memory.budget / 2**30, 1) == 136.0
    assert plan.memory.sglang_kv_token_bytes == 46 * 2 * 1 * 128 * 2


def test_logprobs_cli_on_a_checkpoint_with_its_mtp_layer(air_like_model: Path, tmp_path: Path) -> None:
    """`megatron-rl logprobs` on a GLM checkpoint as released (with its MTP layer) scores like transformers."""
    import subprocess
    import sys

    from tests.hf_reference import assert_matches_hf, hf_score, make_samples

    model_dir = add_mtp_layer(air_like_model, tmp_path / "with_mtp")
    samples = make_samples(vocab=128, n=3, seed=1)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    cmd = [sys.executable, "-m", "megatron_rl.cli", "logprobs", "--hf-model", str(model_dir)]
    cmd += ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(multi-token prediction layer" in proc.stderr
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert_matches_hf(got, hf_score(air_like_model, samples))
