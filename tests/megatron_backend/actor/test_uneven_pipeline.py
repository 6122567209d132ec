"""Uneven pipeline stages: a 3-layer Qwen3-MoE at PP=2 with 2+1 and 1+2 layers reproduces the single process.

Each layout runs `scripts/uneven_pipeline_check.py` under torchrun (gloo): it scores a batch (log-probs,
entropy, routed experts), exports the weights back to HF and trains one PPO step. Layer 1 is dense, so the two
MoE layers sit on different stages in one split and on the same stage in the other. Tolerances as in
test_layouts.py (fp32): log-probs and entropy 5e-6 absolute, loss 1e-6 absolute, grad norm 1e-5 relative;
routes and exported weights identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe
from tests.dist_harness import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "uneven_pipeline_check.py"

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def three_layer_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyQwen3MoeSpec(num_hidden_layers=3, mlp_only_layers=(1,))
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("three_layers"), spec, seed=11)


def _run(model: Path, out: Path, nproc: int, extra: list[str]) -> dict:
    run_torchrun(SCRIPT, nproc, ["--model", str(model), "--out", str(out), *extra], timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single_process(three_layer_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(three_layer_moe, tmp_path_factory.mktemp("uneven") / "single.json", 1, [])


@pytest.mark.parametrize(("first", "last", "stages"), [(2, 1, [[0, 1], [2]]), (1, 2, [[0], [1, 2]])])
def test_uneven_stages_match_single_process(
    first: int, last: int, stages: list, single_process: dict, three_layer_moe: Path, tmp_path: Path
) -> None:
    split = ["--pp", "2", "--first", str(first), "--last", str(last)]
    got = _run(three_layer_moe, tmp_path / f"pp2_{first}_{last}.json", 2, split)
    ref = single_process
    assert ref["stage_layers"] == [[0, 1, 2]]
    assert got["stage_layers"] == stages, "Megatron built other layers on each stage than the split asks for"
    lp_err = (torch.tensor(got["log_probs"]) - torch.tensor(ref["log_probs"])).abs().max().item()
    ent_err = (torch.tensor(got["entropy"]) - torch.tensor(ref["entropy"])).abs().max().item()
    assert lp_err < 5e-6, f"{first}+{last}: log-prob error {lp_err}"
    assert ent_err < 5e-6, f"{first}+{last}: entropy error {ent_err}"
    # Routes where tokens exist (padding positions route whatever padding their micro-batch held).
    valid = torch.tensor(ref["log_probs"]) != 0
    valid[:, 0] = True
    got_routes, ref_routes = torch.tensor(got["routes"]), torch.tensor(ref["routes"])
    assert got_routes.shape == ref_routes.shape and ref_routes.shape[2] == 2  # [batch, seq, MoE layers, top-k]
    assert torch.equal(got_routes[valid], ref_routes[valid]), f"{first}+{last}: routed experts differ"
    assert got["export_equal"] and ref["export_equal"], "exported weights are not bitwise equal to the checkpoint"
    assert got["ppo_kl"] == 0.0 == ref["ppo_kl"]
    assert abs(got["loss"] - ref["loss"]) < 1e-6, f"loss {got['loss']} vs {ref['loss']}"
    assert abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"] < 1e-5, (got["grad_norm"], ref["grad_norm"])


def test_logprobs_cli_at_uneven_stages_matches_transformers(three_layer_moe: Path, tmp_path: Path) -> None:
    """`megatron-rl logprobs --pp 2 --pp-first-stage-layers 2 --pp-last-stage-layers 1`: transformers' log-probs,
    entropy (1e-4, fp32) and experts of both MoE layers, which sit on different stages."""
    from tests.commands.test_logprobs_cli import _write
    from tests.hf_reference import assert_matches_hf, hf_score, make_samples

    samples = make_samples(vocab=128, n=4, seed=5)
    inp, out = _write(tmp_path / "in.jsonl", samples), tmp_path / "out.jsonl"
    split = ["--pp", "2", "--pp-first-stage-layers", "2", "--pp-last-stage-layers", "1"]
    run_torchrun(
        Path(__file__).parents[3] / "megatron_rl" / "cli.py",
        2,
        ["logprobs", "--hf-model", str(three_layer_moe), "--input", str(inp), "--output", str(out), *split],
    )
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert_matches_hf(got, hf_score(three_layer_moe, samples))
