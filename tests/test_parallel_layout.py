"""Tests for `megatron_rl.parallel_layout`: derived degrees, every error path, the
config kwargs Megatron accepts, and a 2-rank torchrun smoke test in which TP=2+SP, EP=2, PP=2,
PP=2 x VPP=2 and DP=2 with the distributed optimizer reproduce the single-process trajectory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_rl.parallel_layout import LayoutError, ParallelLayout, propose_uneven_split
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

# --------------------------------------------------------------------------------------
# Derived degrees
# --------------------------------------------------------------------------------------


def test_defaults_are_pure_data_parallel() -> None:
    layout = ParallelLayout()
    resolved = layout.resolve(4)
    assert (resolved.dp, resolved.expert_dp, resolved.etp, resolved.sp) == (4, 4, 1, False)
    assert layout.dp(1) == 1


@pytest.mark.parametrize(
    ("layout", "world", "dp", "expert_dp"),
    [
        (ParallelLayout(tp=2), 8, 4, 4),
        (ParallelLayout(tp=2, pp=2), 8, 2, 2),
        (ParallelLayout(tp=2, cp=2), 8, 2, 4),  # cp ranks fold into expert data parallelism
        (ParallelLayout(ep=4), 8, 8, 2),
        (ParallelLayout(tp=2, ep=2, etp=1), 2, 1, 1),  # MoE parallel folding: experts reuse TP ranks
        (ParallelLayout(tp=2, pp=2, ep=4, etp=1), 16, 4, 2),
    ],
)
def test_dp_is_derived_from_world_size(layout: ParallelLayout, world: int, dp: int, expert_dp: int) -> None:
    resolved = layout.resolve(world)
    assert layout.dp(world) == resolved.dp == dp
    assert resolved.expert_dp == expert_dp
    assert resolved.world_size == world
    # Both groupings cover every rank of a pipeline stage.
    assert resolved.dp * resolved.cp * resolved.tp == resolved.expert_dp * resolved.ep * resolved.etp


def test_sequence_parallel_defaults_on_with_tp_and_etp_defaults_to_tp() -> None:
    assert ParallelLayout(tp=2).sequence_parallel
    assert not ParallelLayout(tp=1).sequence_parallel
    assert not ParallelLayout(tp=2, sp=False).sequence_parallel
    assert ParallelLayout(tp=4).expert_tp == 4
    assert ParallelLayout(tp=4, etp=1).expert_tp == 1


def test_layout_is_frozen_and_documented() -> None:
    layout = ParallelLayout()
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 2  # type: ignore[misc]
    for f in dataclasses.fields(ParallelLayout):
        assert len(f.metadata.get("help", "")) > 20, f.name


# --------------------------------------------------------------------------------------
# Error paths: each says why
# --------------------------------------------------------------------------------------


def test_world_size_must_divide_by_model_parallel_size() -> None:
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*pp\*cp = 4 \(tp=2, pp=2, cp=1\)"):
        ParallelLayout(tp=2, pp=2).resolve(6)
    with pytest.raises(LayoutError, match="not divisible by tp"):
        ParallelLayout(cp=4).dp(2)


def test_expert_parallel_must_fold_into_a_pipeline_stage() -> None:
    with pytest.raises(LayoutError, match=r"ep\*etp = 4\*1 = 4 must divide dp\*cp\*tp = 2\*1\*1 = 2"):
        ParallelLayout(ep=4).resolve(2)
    with pytest.raises(LayoutError, match=r"ep\*etp = 2\*2 = 4 must divide dp\*cp\*tp = 1\*1\*2 = 2"):
        ParallelLayout(tp=2, ep=2).resolve(2)  # etp defaults to tp
    with pytest.raises(LayoutError, match="expert parallelism does not fold"):
        ParallelLayout(pp=2, ep=4).resolve(4)


def test_experts_must_divide_by_ep() -> None:
    with pytest.raises(LayoutError, match="num_experts=6 is not divisible by ep=4"):
        ParallelLayout(ep=4).validate(4, num_experts=6)
    assert ParallelLayout(ep=4).validate(4, num_experts=8).expert_dp == 1


def test_heads_and_query_groups_must_divide_by_tp() -> None:
    with pytest.raises(LayoutError, match="num_attention_heads=6 is not divisible by tp=4"):
        ParallelLayout(tp=4).validate(4, num_attention_heads=6)
    with pytest.raises(LayoutError, match="num_query_groups=2 is not divisible by tp=4"):
        ParallelLayout(tp=4).validate(4, num_attention_heads=8, num_query_groups=2)


def test_layers_must_divide_by_pipeline_chunks() -> None:
    with pytest.raises(LayoutError, match="num_layers=3 is not divisible by pp = 2"):
        ParallelLayout(pp=2).validate(2, num_layers=3)
    with pytest.raises(LayoutError, match=r"num_layers=6 is not divisible by pp\*vpp = 2\*2 = 4"):
        ParallelLayout(pp=2, vpp=2).validate(2, num_layers=6)
    ParallelLayout(pp=2, vpp=2).validate(2, num_layers=8)


def test_uneven_stages_split_the_layers_as_configured() -> None:
    assert ParallelLayout(pp=2, pp_first_stage_layers=2).validate(2, num_layers=3).stage_layers == (2, 1)
    assert ParallelLayout(pp=2, pp_last_stage_layers=2).validate(2, num_layers=3).stage_layers == (1, 2)
    both = ParallelLayout(pp=4, pp_first_stage_layers=3, pp_last_stage_layers=2)
    assert both.validate(4, num_layers=61).stage_layers == (3, 28, 28, 2)
    assert ParallelLayout(pp=2).validate(2, num_layers=4).stage_layers == (2, 2)
    assert ParallelLayout(pp=2).validate(2).stage_layers is None  # no model given


def test_uneven_stages_are_refused_with_reasons() -> None:
    with pytest.raises(LayoutError, match=r"Set parallel.pp_first_stage_layers=2 and parallel.pp_last_stage_layers=1"):
        ParallelLayout(pp=2).validate(2, num_layers=3)
    with pytest.raises(LayoutError, match="that leaves 1 layer.s. for 0 other stage.s., but each stage holds"):
        ParallelLayout(pp=2, pp_first_stage_layers=1, pp_last_stage_layers=1).validate(2, num_layers=3)
    with pytest.raises(LayoutError, match="that leaves 0 layer.s. for 1 other stage.s."):
        ParallelLayout(pp=2, pp_first_stage_layers=3).validate(2, num_layers=3)
    with pytest.raises(LayoutError, match="leave 5 layers for the other 2 pipeline stages, which must split them"):
        ParallelLayout(pp=3, pp_first_stage_layers=2).validate(3, num_layers=7)
    with pytest.raises(LayoutError, match="3 layers cannot fill 4 pipeline stages: lower pp"):
        ParallelLayout(pp=4).validate(4, num_layers=3)
    with pytest.raises(LayoutError, match="pp_first_stage_layers=2 requires pp > 1"):
        ParallelLayout(pp_first_stage_layers=2)
    with pytest.raises(LayoutError, match="pp_last_stage_layers must be a positive integer or None"):
        ParallelLayout(pp=2, pp_last_stage_layers=0)
    with pytest.raises(LayoutError, match="uneven pipeline stages are supported without interleaving only"):
        ParallelLayout(pp=2, vpp=2, pp_first_stage_layers=2)


@pytest.mark.parametrize(
    ("num_layers", "pp", "split"), [(3, 2, (2, 1)), (61, 16, (3, 2)), (7, 3, (3, 2)), (94, 16, (5, 5)), (2, 3, None)]
)
def test_proposed_split_is_valid_and_balanced(num_layers: int, pp: int, split: tuple[int, int] | None) -> None:
    assert propose_uneven_split(num_layers, pp) == split
    if split is not None:
        layout = ParallelLayout(pp=pp, pp_first_stage_layers=split[0], pp_last_stage_layers=split[1])
        stages = layout.stage_layers(num_layers)
        assert sum(stages) == num_layers and max(stages) == -(-num_layers // pp)


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(pp=2, pp_first_stage_layers=2),
        ParallelLayout(pp=2, pp_last_stage_layers=2),
        ParallelLayout(pp=4, pp_first_stage_layers=1, pp_last_stage_layers=2),
        ParallelLayout(pp=3, pp_last_stage_layers=1),
    ],
)
def test_stage_offsets_equal_megatrons_layer_offsets(layout: ParallelLayout) -> None:
    """Megatron numbers each layer (layer_number - 1 is its global index, which the weight mapping and routing
    replay use) from get_transformer_layer_offset: it must start each stage where `stage_layers` says."""
    import torch

    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers = 7 if layout.pp == 4 else 5
    stages = layout.validate(layout.pp, num_layers=num_layers).stage_layers
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        add_bias_linear=False,
        **layout.to_model_parallel_config_kwargs(pipeline_dtype=torch.float32),
    )
    offsets = [get_transformer_layer_offset(config, pp_rank=rank) for rank in range(layout.pp)]
    assert offsets == [sum(stages[:rank]) for rank in range(layout.pp)]


def test_vpp_requires_pipeline_parallelism() -> None:
    with pytest.raises(LayoutError, match="vpp=2 requires pp > 1"):
        ParallelLayout(vpp=2)
    with pytest.raises(LayoutError, match="vpp must be None .* or an integer >= 2"):
        ParallelLayout(pp=2, vpp=1)


@pytest.mark.parametrize("bad", [{"tp": 0}, {"pp": -1}, {"ep": 1.5}, {"cp": True}, {"etp": 0}])
def test_degrees_must_be_positive_integers(bad: dict) -> None:
    with pytest.raises(LayoutError, match="must be a positive integer"):
        ParallelLayout(**bad)


def test_sequence_parallel_needs_tensor_parallelism() -> None:
    with pytest.raises(LayoutError, match="sp=True requires tp > 1"):
        ParallelLayout(sp=True)


def test_moe_with_tp_requires_sequence_parallel() -> None:
    with pytest.raises(LayoutError, match="MoE with tp=2 requires sequence parallelism, but sp=False"):
        ParallelLayout(tp=2, sp=False).validate(2)
    assert ParallelLayout(tp=2).validate(2).sp  # sp=None turns it on
    assert not ParallelLayout(tp=2, sp=False).validate(2, is_moe=False).sp  # dense models may opt out


def test_interleaved_pp2_with_batched_p2p_is_refused() -> None:
    layout = ParallelLayout(pp=2, vpp=2)
    with pytest.raises(LayoutError, match="silently mis-pairs messages") as err:
        layout.validate(2, batch_p2p_comm=True)
    assert "batch_p2p_comm=False" in str(err.value)
    layout.validate(2, batch_p2p_comm=False)
    ParallelLayout(pp=4, vpp=2).validate(4, batch_p2p_comm=True)  # distinct prev/next peers: fine


def test_initialize_checks_world_size_before_building_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    with pytest.raises(LayoutError, match="world size 3"):
        ParallelLayout(tp=2).initialize()


# --------------------------------------------------------------------------------------
# Config kwargs
# --------------------------------------------------------------------------------------


def test_config_kwargs() -> None:
    import torch

    kwargs = ParallelLayout(tp=2, pp=2, vpp=2, ep=2, etp=1).to_model_parallel_config_kwargs(
        pipeline_dtype=torch.bfloat16
    )
    assert kwargs == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
        "sequence_parallel": True,
        "pipeline_dtype": torch.bfloat16,
        "batch_p2p_comm": False,
        "overlap_p2p_comm": False,
    }
    plain = ParallelLayout().to_model_parallel_config_kwargs()
    assert "batch_p2p_comm" not in plain and "pipeline_dtype" not in plain


@pytest.mark.parametrize(
    "layout", [ParallelLayout(tp=2), ParallelLayout(pp=2, vpp=2), ParallelLayout(tp=2, ep=2, etp=1)]
)
def test_config_kwargs_are_accepted_by_transformer_config(layout: ParallelLayout) -> None:
    import torch

    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        add_bias_linear=False,
        **layout.to_model_parallel_config_kwargs(pipeline_dtype=torch.float32),
    )
    assert config.tensor_model_parallel_size == layout.tp
    assert config.sequence_parallel == layout.sequence_parallel
    if layout.vpp:
        assert config.batch_p2p_comm is False


# --------------------------------------------------------------------------------------
# Smoke: every layout reproduces the single-process trajectory (2 ranks, gloo)
# --------------------------------------------------------------------------------------

SMOKE_LAYOUTS = ["tp2_sp", "ep2", "pp2", "pp2_vpp2", "dp2_distopt"]
SMOKE_RTOL = 1e-5  # measured worst case 3e-7 (TP=2+SP grad norm), fp32 reduction order

# (API, file) pairs the CPU bridges are known to handle on these paths in megatron-core 0.16.x.
# A new pair after an upgrade is a new CUDA assumption: check it, then add it here.
KNOWN_CUDA_SITES_016 = {
    ("Tensor.type()", "megatron/core/optimizer/clip_grads.py"),
    ("Tensor.type()", "megatron/core/optimizer/distrib_optimizer.py"),
    ("WrappedTorchNorm(sequence_parallel=True)", "megatron/core/transformer/spec_utils.py"),
    ("_get_cuda_rng_state", "megatron/core/tensor_parallel/random.py"),
    ("_set_cuda_rng_state", "megatron/core/tensor_parallel/random.py"),
    ("device='cuda'", "megatron/core/optimizer/clip_grads.py"),
    ("device='cuda'", "megatron/core/optimizer/optimizer.py"),
    ("device='cuda'", "megatron/core/pipeline_parallel/schedules.py"),
    ("device='cuda'", "megatron/core/utils.py"),
    ("get_default_causal_mask", "megatron/core/fusions/fused_softmax.py"),
    ("maybe_move_tensor_to_cpu(as_numpy)", "megatron/core/transformer/moe/token_dispatcher.py"),
    ("torch.cuda.Stream", "megatron/core/transformer/moe/token_dispatcher.py"),
    ("torch.cuda.current_device", "megatron/core/distributed/param_and_grad_buffer.py"),
    ("torch.cuda.current_device", "megatron/core/pipeline_parallel/p2p_communication.py"),
    ("torch.cuda.current_device", "megatron/core/tensor_parallel/layers.py"),
    ("torch.cuda.current_device", "megatron/core/tensor_parallel/mappings.py"),
    ("torch.cuda.current_device", "megatron/core/transformer/moe/router.py"),
    ("torch.cuda.current_device", "megatron/core/utils.py"),
    ("torch.cuda.current_stream", "megatron/core/transformer/moe/token_dispatcher.py"),
    ("torch.cuda.get_rng_state", "megatron/core/tensor_parallel/random.py"),
    ("torch.cuda.manual_seed", "megatron/core/tensor_parallel/random.py"),
    ("torch.cuda.stream", "megatron/core/transformer/moe/token_dispatcher.py"),
    ("torch.cuda.synchronize", "megatron/core/pipeline_parallel/p2p_communication.py"),
}


@pytest.mark.torchrun
def test_smoke_layouts_match_single_process(megatron_world, tmp_path: Path) -> None:  # noqa: F811
    from megatron_rl.megatron_backend import platform
    from tests import dist_harness

    # Reference: this process is a world of one (TP=PP=EP=DP=1).
    model = dist_harness.SMOKE_MODEL
    trainer = dist_harness.make_trainer(model, ParallelLayout(), seed=1234)
    reference = dist_harness.train(trainer, model.token_batches(3, seed=1234))
    assert reference["loss"][0] > reference["loss"][1] > reference["loss"][2]

    out = tmp_path / "layouts.json"
    dist_harness.run_torchrun(
        dist_harness.SCRIPTS / "smoke_layouts.py",
        nproc=2,
        args=["--out", str(out), "--layouts", ",".join(SMOKE_LAYOUTS), "--steps", "3", "--seed", "1234"],
        timeout=240,
    )
    results = json.loads(out.read_text())
    for name in SMOKE_LAYOUTS:
        for metric in ("loss", "grad_norm"):
            assert results[name][metric] == pytest.approx(reference[metric], rel=SMOKE_RTOL, abs=0), (name, metric)
        if "logprob_max_abs_diff" in results[name]:  # after training |log-prob| reaches ~8: 1 fp32 ulp = 9.5e-7
            assert results[name]["logprob_max_abs_diff"] <= 2e-6, name

    sites = {(api, site.split(":")[0]) for api, by_site in results["_cuda_hits"].items() for site in by_site}
    if platform.installed_megatron_version().startswith("0.16."):
        assert not sites - KNOWN_CUDA_SITES_016, f"new CUDA assumptions in Megatron: {sites - KNOWN_CUDA_SITES_016}"
