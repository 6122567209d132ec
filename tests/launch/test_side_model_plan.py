"""Frozen side models in the launch plan: their GPUs counted on the rollout nodes of a disaggregated job, the shell
values the SLURM templates read, and the plans that cannot hold them refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.launch.plan import ClusterSpec, PlanError, format_plan, make_plan, shell_plan

REPO = Path(__file__).resolve().parents[2]
QWEN30B = json.loads((REPO / "examples" / "hf_configs" / "qwen3_30b_a3b.json").read_text())
DISAGG = REPO / "examples" / "qwen3_235b_a22b_gspo_disaggregated.yaml"


def _disaggregated(side_models: str, *overrides: str):
    return load_config(DISAGG, [f"rollout.side_models={side_models}", "rollout.sglang.tp_size=4", *overrides])


def test_side_servers_take_the_last_rollout_gpus_and_rollout_servers_the_rest() -> None:
    """Qwen3-30B-A3B on 20 nodes x 8 GPUs, 4 rollout nodes = 32 rollout GPUs: a judge of 2 servers x tp=2 and a
    teacher of tp=4 take 8 of them from the top of the last node, the tp=4 rollout servers the other 24."""
    cfg = _disaggregated(
        "[{name: judge, hf_path: /m/judge, num_servers: 2, tp: 2}, {name: teacher, hf_path: /m/teacher, tp: 4},"
        " {name: far, hf_path: /m/far, urls: ['http://10.0.0.9:30000']}]"
    )
    plan = make_plan(cfg, QWEN30B, ClusterSpec(20, 8, 80, rollout_nodes=4))
    side = [(s.name, s.node, s.gpus, s.port) for s in plan.side_servers]
    assert side == [("judge", 19, (6, 7), 30300), ("judge", 19, (4, 5), 30301), ("teacher", 19, (0, 1, 2, 3), 30302)]
    rollout = [(s.node, s.gpus) for s in plan.servers]
    assert rollout == [(n, g) for n in (16, 17, 18) for g in ((0, 1, 2, 3), (4, 5, 6, 7))]
    assert sum(len(s.gpus) for s in plan.servers) + sum(len(s.gpus) for s in plan.side_servers) == 32
    shell = shell_plan(plan, cfg)
    assert "PLAN_SIDE_MODELS='0 1'" in shell
    assert "PLAN_SIDE_SERVERS='0:19:30300:6,7 0:19:30301:4,5 1:19:30302:0,1,2,3'" in shell
    assert "PLAN_SIDE_0_PATH=/m/judge" in shell and "PLAN_SIDE_1_TP=4" in shell
    assert "PLAN_SIDE_0_MEM_FRACTION=0.8" in shell
    assert "PLAN_SIDE_2" not in shell  # `far` runs elsewhere: connected, not launched
    text = format_plan(plan)
    assert "side model teacher: node 19, port 30302, GPUs [0, 1, 2, 3]" in text
    assert "note: side model far: running at http://10.0.0.9:30000" in text


def test_side_servers_spill_to_the_node_before_when_the_last_is_full() -> None:
    cfg = _disaggregated("[{name: judge, hf_path: /m/judge, num_servers: 3, tp: 4}]")
    plan = make_plan(cfg, QWEN30B, ClusterSpec(20, 8, 80, rollout_nodes=4))
    assert [(s.node, s.gpus) for s in plan.side_servers] == [(19, (4, 5, 6, 7)), (19, (0, 1, 2, 3)), (18, (4, 5, 6, 7))]
    assert [(s.node, s.gpus) for s in plan.servers if s.node >= 18] == [(18, (0, 1, 2, 3))]


def test_gpus_a_rollout_server_cannot_use_are_named() -> None:
    cfg = _disaggregated("[{name: judge, hf_path: /m/judge, tp: 2}]")
    plan = make_plan(cfg, QWEN30B, ClusterSpec(20, 8, 80, rollout_nodes=4))
    assert [(s.node, s.gpus) for s in plan.servers if s.node == 19] == [(19, (0, 1, 2, 3))]
    idle = "2 rollout GPU(s) serve nothing: the side models leave fewer than rollout.sglang.tp_size=4 on node(s) [19]"
    assert idle in plan.notes


@pytest.mark.parametrize(
    ("side_models", "rollout_nodes", "reason"),
    [
        ("[{name: judge, hf_path: /m, num_servers: 9, tp: 4}]", 4,
         "rollout.side_models judge needs 9 server(s) of tp=4 GPUs on one node, but the rollout nodes (4 x 8 GPUs) "
         "have no room left (side models take 36)"),
        ("[{name: judge, hf_path: /m, tp: 16}]", 4, "needs 1 server(s) of tp=16 GPUs on one node"),
        ("[{name: judge, hf_path: /m, num_servers: 2, tp: 4}]", 1,
         "no rollout server fits: the side models take 8 of the 8 rollout GPUs"),
    ],
)  # fmt: skip
def test_rollout_nodes_without_room_for_the_side_models_are_refused(side_models, rollout_nodes, reason) -> None:
    cfg = _disaggregated(side_models)
    with pytest.raises(PlanError, match="impossible plan") as err:
        make_plan(cfg, QWEN30B, ClusterSpec(16 + rollout_nodes, 8, 80, rollout_nodes=rollout_nodes))
    assert reason in str(err.value), str(err.value)


def test_a_colocated_job_says_what_its_side_models_need_or_connects_to_their_urls() -> None:
    example = REPO / "examples" / "qwen3_30b_a3b_gspo_2x8xh100.yaml"
    launched = "rollout.side_models=[{name: judge, hf_path: /m, num_servers: 2, tp: 2}]"
    with pytest.raises(PlanError) as err:
        make_plan(load_config(example, [launched]), QWEN30B, ClusterSpec(2, 8, 80))
    assert (
        "rollout.side_models judge need 4 GPU(s) of their own (num_servers x tp), but a colocated job trains on every "
        "GPU: give their urls (servers run elsewhere), or set trainer.colocate=false"
    ) in str(err.value)
    connected = "rollout.side_models=[{name: judge, hf_path: /m, urls: ['http://10.0.0.9:30000']}]"
    plan = make_plan(load_config(example, [connected]), QWEN30B, ClusterSpec(2, 8, 80))
    assert plan.side_servers == () and "PLAN_SIDE_SERVERS=''" in shell_plan(plan, load_config(example, [connected]))
