"""The critic in TP=2 with sequence parallelism, EP=2, PP=2 and DP=2 reproduces the single process (TP=1).

`scripts/critic_layout_check.py` runs the four layouts one after another in one torchrun job of 2 ranks (gloo)
and the single process here: each computes a fixed batch's per-token values, takes two updates with the trainer's
clipped value loss (the first on fresh old values, so nothing clips; the second with the values moved, so about half
the tokens clip and their gradient is cut), and computes the values again. Tolerances are the actor's layout tests'
(fp32): values 5e-6 absolute, loss 1e-6 absolute, grad norm 1e-5 relative. Measured (CPU, torch 2.13,
megatron-core 0.16.1): values within 3.9e-7 (before and after the updates), losses within 3.6e-8, grad norms within
8.1e-8 relative. A head that summed the sequence-parallel gather's gradient over TP ranks is 93-95% off in the grad
norm at TP=2; a head counted on both TP ranks in the norm, 3-4%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel_layout import ParallelLayout
from tests.dist_harness import run_torchrun
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.megatron_backend.critic.scripts.critic_layout_check import LAYOUTS, critic_numbers, fixed_batch

SCRIPT = Path(__file__).parent / "scripts" / "critic_layout_check.py"


@pytest.fixture(scope="module")
def single_process(tiny_moe_dir: Path, megatron_world) -> dict:  # noqa: F811
    return critic_numbers(tiny_moe_dir, ParallelLayout(), megatron_world)


def test_single_process_reference_is_informative(single_process: dict) -> None:
    """The reference values are not ~0, padding and position 0 hold none, the first update clips nothing, the
    second clips a good share of the tokens, and the updates move the values."""
    values, after = torch.tensor(single_process["values"]), torch.tensor(single_process["values_after"])
    batch, _ = fixed_batch()
    outside = torch.arange(values.shape[1])[None, :] >= batch.lengths[:, None]
    assert values.abs().max() > 0.1 and not values[outside].any() and not values[:, 0].any()
    first, second = single_process["steps"]
    assert first["clip_frac"] == 0.0 and 0.2 < second["clip_frac"] < 0.8, single_process["steps"]
    assert first["count"] == second["count"] == int(batch.response_mask().sum())
    assert first["grad_norm"] > 0 and second["grad_norm"] > 0
    assert (after - values).abs().mean() > 1e-2


@pytest.fixture(scope="module")
def layouts(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("critic_layouts") / "critic_layouts.json"
    run_torchrun(SCRIPT, 2, [str(tiny_moe_dir), str(out)], timeout=600)
    results = json.loads(out.read_text())
    assert set(results) == set(LAYOUTS)
    return results


@pytest.mark.torchrun
def test_critic_layouts_match_single_process(single_process: dict, layouts: dict) -> None:
    ref = single_process
    for name, got in layouts.items():
        for key in ("values", "values_after"):
            err = (torch.tensor(got[key]) - torch.tensor(ref[key])).abs().max().item()
            assert err < 5e-6, f"{name}: {key} differ from the single process by {err}"
        for step, (a, b) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
            assert abs(a["loss"] - b["loss"]) < 1e-6, f"{name} update {step}: loss {a['loss']} vs {b['loss']}"
            rel = abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
            assert rel < 1e-5, f"{name} update {step}: grad norm {a['grad_norm']} vs {b['grad_norm']}"
            assert abs(a["clip_frac"] - b["clip_frac"]) < 1e-6 and a["count"] == b["count"], (name, step, a, b)


@pytest.mark.torchrun
def test_launch_planner_counts_the_most_loaded_ranks_critic(single_process: dict, layouts: dict) -> None:
    """`launch/critic_memory.critic_params` is the parameter count of the most loaded rank: exactly at TP=1 (one
    process, EP=2, PP=2 where the first stage holds the embedding and the last the value head, DP=2). At TP=2 it is
    below by what the planner leaves out for every model: the layers' norms and routers, which Megatron replicates
    over TP, are split, and the vocabulary is not padded to a multiple of 128 x TP (5184 of the tiny model's 121088
    parameters per rank; under 0.1% of Qwen3-30B-A3B's)."""
    for name, got in {"single": single_process, **layouts}.items():
        if name == "tp2_sp":
            assert 0 < got["params"] - got["planned"] < 0.05 * got["params"], got
        else:
            assert got["params"] == got["planned"], (name, got["params"], got["planned"])
    assert all(layouts[n]["params"] < 0.7 * single_process["params"] for n in ("tp2_sp", "ep2", "pp2"))  # split
