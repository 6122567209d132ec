"""`megatron-rl launch --dry-run`: rank coordinates equal Megatron-Core's own rank groups, node roles for
colocated and disaggregated jobs, memory arithmetic, and impossible plans refused with their reasons."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.launch.plan import ClusterSpec, PlanError, format_plan, make_plan, shell_plan

REPO = Path(__file__).resolve().parents[2]
QWEN30B = REPO / "examples" / "hf_configs" / "qwen3_30b_a3b.json"
QWEN235B = REPO / "examples" / "hf_configs" / "qwen3_235b_a22b.json"


def _hf(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def _cfg(example: str, *overrides: str):
    return load_config(REPO / "examples" / example, list(overrides))


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "etp", "nodes", "gpus"),
    [(1, 1, 8, 1, 1, 8), (2, 1, 8, 1, 2, 8), (2, 2, 4, 1, 2, 8), (4, 2, 2, 2, 4, 8), (1, 4, 2, 1, 1, 8)],
)
def test_rank_coordinates_match_megatron_rank_generator(tp, pp, ep, etp, nodes, gpus) -> None:
    from megatron.core.parallel_state import RankGenerator

    cfg = _cfg("qwen3_30b_a3b_gspo_8xh100.yaml", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}",
               f"parallel.etp={etp}", "rollout.engine=local")  # fmt: skip
    plan = make_plan(cfg, _hf(QWEN30B), ClusterSpec(nodes, gpus, gpu_memory_gib=10_000))
    lay = plan.layout
    dense = RankGenerator(tp=tp, ep=1, dp=lay.dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=lay.expert_dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    checks = [("tp", dense, "tp"), ("dp", dense, "dp"), ("pp", dense, "pp"), ("tp", expert, "etp"),
              ("ep", expert, "ep"), ("dp", expert, "edp")]  # fmt: skip
    for name, generator, coordinate in checks:
        for group in generator.get_ranks(name):
            # Inside one Megatron group, ranks differ exactly in this coordinate, which counts 0, 1, 2, ...
            assert [getattr(plan.ranks[r], coordinate) for r in group] == list(range(len(group))), (name, group)
    assert [r.node for r in plan.ranks] == [r // gpus for r in range(nodes * gpus)]


def test_colocated_two_nodes_places_servers_and_router_on_every_node() -> None:
    cfg = _cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml")
    plan = make_plan(cfg, _hf(QWEN30B), ClusterSpec(2, 8, 80))
    assert plan.mode == "colocated" and plan.trainer_nodes == [0, 1] and plan.rollout_nodes == [0, 1]
    assert [(s.node, s.gpus) for s in plan.servers] == [(0, tuple(range(8))), (1, tuple(range(8)))]
    assert plan.router == (0, 30100)
    assert plan.memory.total <= plan.memory.budget
    shell = shell_plan(plan, cfg)
    assert "PLAN_TRAIN_NODES='0 1'" in shell and "PLAN_ROUTER_NODE=0" in shell
    assert "PLAN_SERVERS='0:30000:0,1,2,3,4,5,6,7 1:30000:0,1,2,3,4,5,6,7'" in shell and "PLAN_SIDE_SERVERS=''" in shell
    assert "PLAN_MEMORY_SAVER=1" in shell  # the template starts SGLang with --enable-memory-saver


def test_memory_arithmetic_of_the_30b_example_by_hand() -> None:
    """Qwen3-30B-A3B at tp=2, ep=16, etp=1 on 16 GPUs: every number recomputed here from the config."""
    cfg = _cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml")
    plan = make_plan(cfg, _hf(QWEN30B), ClusterSpec(2, 8, 80))
    h, layers, experts, inter, vocab = 2048, 48, 128, 768, 151936
    attention = 2 * h * 32 * 128 + 2 * h * 4 * 128 + 2 * 128 + 2 * h
    expert_params = experts * 3 * h * inter
    total = layers * (attention + experts * h + expert_params) + 2 * vocab * h + h
    assert plan.params["total"] == total  # 30.5 B
    assert abs(total / 1e9 - 30.53) < 0.01
    dense = layers * (attention + experts * h) / 2 + vocab * h / 2 * 2  # tp=2; pp=1 holds embedding and head
    expert = layers * expert_params / 16
    assert plan.memory.weights == pytest.approx((dense + expert) * 2)
    assert plan.memory.optimizer == pytest.approx(dense * 12 / 8 + expert * 12 / 1)  # dp=8, expert-dp=1


@pytest.mark.parametrize(
    ("example", "overrides", "cluster", "reasons"),
    [
        ("qwen3_30b_a3b_gspo_8xh100.yaml", ("optimizer.cpu_offload=false", "optimizer.precision_aware=false"),
         ClusterSpec(1, 8, 80), ["training needs ~89.7 GiB per GPU but 75.0 GiB are available"]),
        ("qwen3_30b_a3b_gspo_8xh100.yaml", ("parallel.tp=3",), ClusterSpec(1, 8, 80),
         ["not divisible by tp*pp*cp = 3"]),
        ("qwen3_30b_a3b_gspo_8xh100.yaml", ("parallel.ep=16",), ClusterSpec(1, 8, 80),
         ["expert parallelism does not fold"]),
        ("qwen3_30b_a3b_gspo_8xh100.yaml", ("rollout.sglang.tp_size=3",), ClusterSpec(1, 8, 10_000),
         ["rollout.sglang.tp_size=3 does not divide 8"]),
        ("qwen3_235b_a22b_gspo_disaggregated.yaml", (), ClusterSpec(8, 8, 80, rollout_nodes=0),
         ["needs 1 <= --rollout-nodes < --nodes"]),
        ("qwen3_235b_a22b_gspo_disaggregated.yaml", (), ClusterSpec(19, 8, 80, rollout_nodes=4),
         ["120 training GPUs (15 nodes)", "expert parallelism does not fold"]),
        ("qwen3_235b_a22b_gspo_disaggregated.yaml", ("rollout.sglang.tp_size=4",), ClusterSpec(20, 8, 80, 4),
         ["rollout server's weights need 109.5 GiB per GPU but its share is 72.0 GiB"]),
        ("tiny_moe_gspo.yaml", (), ClusterSpec(2, 1, 80, rollout_nodes=1),
         ["rollout_nodes=1 with trainer.colocate=true"]),
    ],
)  # fmt: skip
def test_impossible_plans_are_refused_with_every_reason(example, overrides, cluster, reasons) -> None:
    hf = _hf(QWEN235B if "235b" in example else QWEN30B)
    with pytest.raises(PlanError) as err:
        make_plan(_cfg(example, *overrides), hf, cluster)
    for reason in reasons:
        assert reason in str(err.value), str(err.value)


def test_disaggregated_235b_plan() -> None:
    cfg = _cfg("qwen3_235b_a22b_gspo_disaggregated.yaml")
    plan = make_plan(cfg, _hf(QWEN235B), ClusterSpec(20, 8, 80, rollout_nodes=4))
    assert plan.mode == "disaggregated"
    assert plan.trainer_nodes == list(range(16)) and plan.rollout_nodes == [16, 17, 18, 19]
    assert plan.router == (16, 30100) and len(plan.servers) == 4
    assert abs(plan.params["total"] / 1e9 - 235.1) < 0.5 and abs(plan.params["active"] / 1e9 - 22.2) < 0.5
    assert plan.memory.total <= plan.memory.budget and plan.memory.sglang_weights <= plan.memory.sglang_budget


def test_cli_dry_run_prints_the_plan_and_refuses_without_dry_run(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "megatron_rl.cli", "launch"]
    ok = subprocess.run([*cli, "--dry-run", "examples/qwen3_235b_a22b_gspo_disaggregated.yaml", "--nodes", "20",
                         "--gpus-per-node", "8", "--rollout-nodes", "4", "--hf-config", str(QWEN235B)],
                        cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "disaggregated plan: 20 node(s) x 8 GPU(s)" in ok.stdout and "sglang-router on node 16" in ok.stdout
    assert "gpu 7: rank 127" in ok.stdout
    no = subprocess.run([*cli, "examples/tiny_moe_gspo.yaml", "--nodes", "1", "--gpus-per-node", "1"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert no.returncode == 2 and "add --dry-run" in no.stderr


def test_colocated_memory_release_and_actor_offload_change_the_budgets() -> None:
    """SGLang's share leaves the training budget only while SGLang keeps it; while SGLang generates, the actor's
    resident state must fit beside that share unless it is offloaded."""
    cluster = ClusterSpec(2, 8, gpu_memory_gib=80)
    swapped = make_plan(_cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml"), _hf(QWEN30B), cluster)
    assert swapped.memory.budget / 2**30 == pytest.approx(80 - 3 - 2)  # CUDA context, released SGLang's rest
    assert swapped.memory.resident_in_rollout == 0
    assert any("releases its weights, KV cache and CUDA graphs" in n for n in swapped.notes)

    kept = make_plan(
        _cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml", "rollout.release_memory=false", "trainer.offload_actor=false",
             "rollout.sglang.mem_fraction_static=0.3"),
        _hf(QWEN30B), cluster,
    )  # fmt: skip
    assert kept.memory.budget / 2**30 == pytest.approx(80 * 0.7 - 3)
    assert any("keeps its mem_fraction_static share" in n for n in kept.notes)

    with pytest.raises(PlanError, match=r"while SGLang generates, the trainer keeps .* trainer.offload_actor=true"):
        make_plan(_cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml", "trainer.offload_actor=false"), _hf(QWEN30B), cluster)
    with pytest.raises(PlanError, match="rollout.release_memory=true frees it during training"):
        make_plan(_cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml", "rollout.release_memory=false"), _hf(QWEN30B), cluster)


def test_planner_counts_the_architecture_its_model_family_describes() -> None:
    """A Qwen2-MoE with every 2nd layer sparse except mlp_only_layers=[3]: the family's MoE layers [1, 5], QKV
    biases, a gated shared expert and no QK-norm; the planner's parameter count equals transformers' own model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.models.architecture import model_dims

    hf = dict(
        model_type="qwen2_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3],
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
    )  # fmt: skip
    plan = make_plan(_cfg("tiny_moe_gspo.yaml"), hf, ClusterSpec(1, 1, 80))
    assert model_dims(hf).moe_layers == [1, 5]
    assert plan.params["experts"] == 2 * 8 * 3 * 64 * 32  # experts only in those two layers
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    assert plan.params["total"] == sum(p.numel() for p in model.parameters())
    active = plan.params["total"] - plan.params["experts"] * (1 - 2 / 8)
    assert plan.params["active"] == pytest.approx(active)


def test_a_model_no_family_builds_is_refused_not_planned_as_dense() -> None:
    qwen3_next = {"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
                  "num_attention_heads": 16, "vocab_size": 151936, "num_experts": 512}  # fmt: skip
    with pytest.raises(PlanError, match=r"impossible plan:\n  - unsupported architecture: .*model_type='qwen3_next'"):
        make_plan(_cfg("tiny_moe_gspo.yaml"), qwen3_next, ClusterSpec(1, 8, 80))


def test_planner_proposes_uneven_stages_when_the_layers_do_not_divide_by_pp() -> None:
    """47 layers at pp=2 are refused with the overrides to set; with them the plan holds 24/23 layers per stage,
    and the most loaded stage (24 layers) costs what a stage of the even 48-layer split costs."""
    odd = {**_hf(QWEN30B), "num_hidden_layers": 47}
    cluster = ClusterSpec(1, 8, 10_000)
    layout = ("parallel.pp=2", "parallel.ep=4")
    cfg = _cfg("qwen3_30b_a3b_gspo_8xh100.yaml", *layout)
    with pytest.raises(PlanError) as err:
        make_plan(cfg, odd, cluster)
    assert "num_layers=47 is not divisible by pp = 2" in str(err.value)
    assert "Set parallel.pp_first_stage_layers=24 and parallel.pp_last_stage_layers=23" in str(err.value)

    uneven = _cfg("qwen3_30b_a3b_gspo_8xh100.yaml", *layout, "parallel.pp_first_stage_layers=24",
                  "parallel.pp_last_stage_layers=23")  # fmt: skip
    plan = make_plan(uneven, odd, cluster)
    assert plan.layout.stage_layers == (24, 23)
    assert "pp=2 (layers per stage 24/23)" in format_plan(plan)
    even = make_plan(cfg, _hf(QWEN30B), cluster)
    assert even.layout.stage_layers == (24, 24) and "layers per stage" not in format_plan(even)
    assert plan.memory.weights == even.memory.weights and plan.memory.activations == even.memory.activations
    assert plan.params["total"] < even.params["total"]

    four = _cfg("qwen3_30b_a3b_gspo_8xh100.yaml", "parallel.pp=4", "parallel.ep=2",
                "parallel.pp_first_stage_layers=12", "parallel.pp_last_stage_layers=12")  # fmt: skip
    with pytest.raises(PlanError, match="leave 23 layers for the other 2 pipeline stages, which must split them"):
        make_plan(four, odd, cluster)


def _qwen30b_shard() -> tuple[float, float, float]:
    """(local dense, local expert, optimizer shard) parameters of one GPU of the one-node 30B example: tp=1, ep=8,
    dp=8, expert-dp=1."""
    h, layers, experts, inter, vocab = 2048, 48, 128, 768, 151936
    attention = 2 * h * 32 * 128 + 2 * h * 4 * 128 + 2 * 128 + 2 * h
    dense = layers * (attention + experts * h) + 2 * vocab * h  # replicated at tp=1, embedding and head
    expert = layers * experts * 3 * h * inter / 8
    return dense, expert, dense / 8 + expert


def test_one_node_30b_example_fits_8xh100_with_the_optimizer_offloaded() -> None:
    """The example's header by hand: the shard's 3.82 B parameters keep their Adam state in host memory (16 B
    each: fp32 master, two fp32 moments, a pinned fp32 gradient copy); 8 B per parameter cross PCIe per update."""
    dense, expert, shard = _qwen30b_shard()
    assert abs(shard / 1e9 - 3.8165) < 1e-3
    cfg = _cfg("qwen3_30b_a3b_gspo_8xh100.yaml")
    assert cfg.optimizer.cpu_offload and cfg.optimizer.precision_aware and cfg.optimizer.offload_fraction == 1.0
    plan = make_plan(cfg, _hf(QWEN30B), ClusterSpec(1, 8, 80))
    m, g = plan.memory, 2**30
    assert m.optimizer == 0.0 and m.host_optimizer == pytest.approx(shard * 16)
    assert m.weights == pytest.approx((dense + expert) * 2) and m.grads == pytest.approx((dense + expert) * 4)
    tokens, vocab = 12288, 151936
    activations, logits = tokens * 2048 * 2 * (48 + 17), tokens * vocab * 2 * 2
    assert m.total == pytest.approx((m.weights + m.grads + activations + logits) * 1.1)
    assert round(m.total / g, 1) == 42.7 and m.total <= m.budget == 75 * g
    assert round(m.host_optimizer / g, 1) == 56.9
    parked = m.weights + m.grads  # trainer.offload_actor: the GPU state waits in host memory during rollout
    assert m.host_per_node == pytest.approx(8 * (shard * 16 + parked)) and round(m.host_per_node / g) == 686
    updates = cfg.algo.mini_batches_per_step * cfg.algo.ppo_epochs  # 4
    assert m.pcie_seconds_per_step == pytest.approx(updates * shard * 8 / 25e9)  # 4.9 s at 25 GB/s
    assert round(m.pcie_seconds_per_step, 1) == 4.9
    text = format_plan(plan)
    assert "optimizer CPU offload: 56.9 GiB of optimizer state per GPU in host memory (686 GiB per node" in text
    assert "~4.9 s of PCIe copies per step" in text

    # Half offloaded: half the state stays on the GPU as the hybrid optimizer's fp32 copy and moments (12 B).
    half = make_plan(_cfg("qwen3_30b_a3b_gspo_8xh100.yaml", "optimizer.offload_fraction=0.5"), _hf(QWEN30B),
                     ClusterSpec(1, 8, 80, pcie_gb_per_s=50))  # fmt: skip
    assert half.memory.optimizer == pytest.approx(shard * 0.5 * 12) and round(half.memory.total / g, 1) == 66.2
    assert half.memory.host_optimizer == pytest.approx(shard * 0.5 * 16)
    assert half.memory.pcie_seconds_per_step == pytest.approx(4 * shard * 0.5 * 8 / 50e9)


@pytest.mark.parametrize(
    ("overrides", "bytes_per_param", "total_gib"),
    [
        (("optimizer.cpu_offload=false", "optimizer.precision_aware=false"), 12, 89.7),  # fp32 master + m + v
        (("optimizer.cpu_offload=false", "optimizer.moments_dtype=fp32"), 2 + 8, 81.8),  # master remainders
        (("optimizer.cpu_offload=false", "optimizer.moments_dtype=bf16"), 2 + 4, 66.2),
        (("optimizer.cpu_offload=false", "optimizer.moments_dtype=fp8"), 2 + 2, 58.4),
        (("optimizer.cpu_offload=false", "optimizer.moments_dtype=fp16", "optimizer.main_params_dtype=fp16"),
         2 + 4, 66.2),
    ],
)  # fmt: skip
def test_precision_aware_dtypes_set_the_bytes_per_moment(overrides, bytes_per_param, total_gib) -> None:
    """GPU optimizer bytes per parameter of the shard: the main copy (2 B: fp16, or fp32 kept as the 16 bits a
    bf16 weight lacks) plus two moments of 4 / 2 / 1 B; nothing in host memory, nothing over PCIe."""
    _, _, shard = _qwen30b_shard()
    cluster = ClusterSpec(1, 8, 10_000)  # roomy GPUs: every variant plans, the numbers are what is tested
    plan = make_plan(_cfg("qwen3_30b_a3b_gspo_8xh100.yaml", *overrides), _hf(QWEN30B), cluster)
    assert plan.memory.optimizer == pytest.approx(shard * bytes_per_param)
    assert plan.memory.host_optimizer == plan.memory.pcie_seconds_per_step == 0
    m = plan.memory
    assert round((m.weights + m.grads + m.optimizer + m.activations + m.logits) * 1.1 / 2**30, 1) == total_gib
    assert "optimizer CPU offload" not in format_plan(plan)


def test_async_plans_say_which_step_the_servers_generate() -> None:
    cfg = _cfg("qwen3_235b_a22b_gspo_disaggregated.yaml", "trainer.mode=async", "rollout.partial=true")
    plan = make_plan(cfg, _hf(QWEN235B), ClusterSpec(20, 8, 80, rollout_nodes=4))
    assert (
        "async (trainer.max_staleness=1): the servers generate the samples of step t+1 while the trainer trains "
        "step t; weights reach them by interrupting and continuing the requests in flight (rollout.partial)"
    ) in plan.notes
    assert not any(note.startswith("async") for note in make_plan(_cfg("qwen3_235b_a22b_gspo_disaggregated.yaml"),
                   _hf(QWEN235B), ClusterSpec(20, 8, 80, rollout_nodes=4)).notes)  # fmt: skip


def test_the_plan_says_where_a_distillation_teacher_lives() -> None:
    """A Megatron teacher of the student's architecture (or of one not read) costs host memory per GPU equal to the
    actor's weights shard (the KL reference's rule)."""
    cluster = ClusterSpec(2, 8, 80)
    base = make_plan(_cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml"), _hf(QWEN30B), cluster)
    notes = {}
    for served in ("megatron", "local_engine", "sglang"):
        distill = ("algo.distill.teacher=/teacher", f"algo.distill.served_by={served}")
        cfg = _cfg("qwen3_30b_a3b_gspo_2x8xh100.yaml", *distill)
        plan = make_plan(cfg, _hf(QWEN30B), cluster)
        (notes[served],) = [n for n in plan.notes if "distillation teacher" in n]
        assert plan.memory == base.memory  # no GPU memory of the trainer's
    assert f"{base.memory.weights / 2**30:.1f} GiB of host memory per GPU" in notes["megatron"]
    assert "second model on rank 0's GPU" in notes["local_engine"] and "own SGLang servers" in notes["sglang"]


def test_a_megatron_teacher_of_another_architecture_is_resident_and_counted(tmp_path: Path, capsys) -> None:
    """A teacher of another size (Qwen3-30B-A3B with 64 layers, not 48) is built in the actor's layout and stays on
    the GPUs: its weights shard per GPU (the actor's own arithmetic for that model) joins the memory estimate and the
    note says it is resident; the student's architecture is still swapped from the host; a teacher whose experts the
    layout cannot split is refused naming both. `launch --dry-run` reads the teacher's config.json from its folder."""
    import argparse
    import json

    from megatron_rl.commands import launch

    example, cluster = "qwen3_30b_a3b_gspo_2x8xh100.yaml", ClusterSpec(2, 8, 80)
    student, deeper = _hf(QWEN30B), {**_hf(QWEN30B), "num_hidden_layers": 64}
    base = make_plan(_cfg(example), student, cluster)
    cfg = _cfg(example, f"algo.distill.teacher={tmp_path}")
    plan = make_plan(cfg, student, cluster, deeper)
    assert plan.memory.teacher == make_plan(_cfg(example), deeper, cluster).memory.weights > 0
    assert plan.memory.total == pytest.approx(base.memory.total + 1.1 * plan.memory.teacher)
    (note,) = [n for n in plan.notes if "distillation teacher" in n]
    assert f"resident on every GPU in the actor's layout: {plan.memory.teacher / 2**30:.1f} GiB" in note
    assert f"+ teacher {plan.memory.teacher / 2**30:.1f} =" in format_plan(plan)
    same = make_plan(cfg, student, cluster, student)
    assert same.memory == base.memory and any("swapped from host memory" in n for n in same.notes)
    with pytest.raises(PlanError, match=r"algo.distill.teacher=\S+ in the actor's parallel layout: num_experts=120 is "
                       "not divisible by ep=16"):  # fmt: skip
        make_plan(cfg, student, cluster, {**student, "num_experts": 120})
    (tmp_path / "config.json").write_text(json.dumps(deeper))
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args([str(REPO / "examples" / example), f"algo.distill.teacher={tmp_path}", "--dry-run",
                              "--nodes", "2", "--gpus-per-node", "8", "--hf-config", str(QWEN30B)])  # fmt: skip
    assert launch.run(args) == 0
    assert note in capsys.readouterr().out
