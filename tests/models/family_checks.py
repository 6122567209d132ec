"""What every model family is checked for, in one place: parity with transformers at every layout, bitwise
export, RL updates with routing replay R2 and R3, and the conversion round trip.

A family's test builds its tiny HF models and calls these. `run_layouts` starts ONE torchrun job per world size
(`scripts/family_layouts.py` walks all the layouts of that size in the same processes), so a family costs two
process starts however many layouts it checks.

Tolerances (fp32): log-probs and entropy within 1e-4 of transformers (`TOL_HF`), expert sets identical at every
position and MoE layer; layouts agree with each other's exported weights bitwise; the first update of a step has
ppo_kl exactly 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.dist_harness import run_torchrun
from tests.hf_reference import assert_matches_hf, hf_score, make_samples

SCRIPT = Path(__file__).parent / "scripts" / "family_layouts.py"
TOL_HF = 1e-4

# The layouts a family is checked at (world size 2): TP=2 with sequence parallelism, EP=2, PP=2 with the
# first stage one layer longer (an odd layer count), and TP=2+SP with EP=2 over the same ranks (expert TP 1).
LAYOUTS_2 = [
    {"name": "tp2_sp", "tp": 2},
    {"name": "ep2", "ep": 2},
    {"name": "pp2_uneven", "pp": 2, "pp_first_stage_layers": 2, "pp_last_stage_layers": 1},
    {"name": "tp2_sp_ep2", "tp": 2, "ep": 2, "etp": 1},
]


def samples_for(model_dir: Path, n: int = 4, seed: int = 0) -> list[dict]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return make_samples(vocab=vocab, n=n, seed=seed)


def run_layouts(model_dir: Path, samples: list[dict], out_dir: Path, nproc: int, layouts: list[dict]) -> dict:
    """Score, export and train at each layout (one torchrun job of `nproc` ranks); results keyed by layout name.

    R3 replays transformers' own routes (what the local engine records), so the same run checks that the trainer
    accepts and reproduces the engine's route layout."""
    ref = hf_score(model_dir, samples)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "samples.json").write_text(json.dumps(samples))
    (out_dir / "r3.json").write_text(json.dumps([r["routed_experts"].tolist() for r in ref]))
    out = out_dir / f"layouts_{nproc}.json"
    args = ["--model", str(model_dir), "--samples", str(out_dir / "samples.json"), "--layouts", json.dumps(layouts)]
    run_torchrun(SCRIPT, nproc, [*args, "--r3-routes", str(out_dir / "r3.json"), "--out", str(out)], timeout=900)
    return json.loads(out.read_text())


def as_samples(result: dict, samples: list[dict]) -> list[dict]:
    """One layout's `[batch, seq]` scores in `assert_matches_hf`'s per-sample layout (response tokens; routes of
    every position but the last)."""
    out = []
    for i, s in enumerate(samples):
        n, start = len(s["input_ids"]), s["response_start"]
        out.append(
            {
                "log_probs": result["log_probs"][i][start:n],
                "entropy": result["entropy"][i][start:n],
                "routed_experts": result["routes"][i][: n - 1],
            }
        )
    return out


def check_layout(result: dict, samples: list[dict], ref: list[dict], name: str) -> float:
    """One layout against transformers, its export and its RL updates; returns the largest log-prob/entropy error."""
    worst = assert_matches_hf(as_samples(result, samples), ref, TOL_HF)
    assert result["export_equal"], f"{name}: HF -> Megatron -> HF export is not bitwise equal to the checkpoint"
    for kind in ("r2", "r3"):
        steps = result[kind]
        assert steps, f"{name}: no {kind} updates ran"
        assert steps[0]["ppo_kl"] == 0.0, f"{name}: {kind} first update has ppo_kl {steps[0]['ppo_kl']} (not 1)"
        assert all(torch.isfinite(torch.tensor([s["loss"], s["grad_norm"]])).all() for s in steps)
    assert result["r2"][1]["ppo_kl"] != 0.0, f"{name}: the second R2 update did not see the policy move"
    return worst


def check_family(model_dir: Path, tmp: Path, layouts: list[dict] | None = None) -> dict[str, float]:
    """TP=1 and every layout of `layouts` (default `LAYOUTS_2`) against transformers; the layouts' first updates
    against TP=1's (loss 1e-5 absolute, grad norm 1e-4 relative). Returns the error per layout (the note's table)."""
    samples = samples_for(model_dir)
    ref = hf_score(model_dir, samples)
    single = run_layouts(model_dir, samples, tmp / "single", 1, [{"name": "tp1"}])["tp1"]
    errors = {"tp1": check_layout(single, samples, ref, "tp1")}
    multi = run_layouts(model_dir, samples, tmp / "multi", 2, layouts or LAYOUTS_2)
    for name, result in multi.items():
        errors[name] = check_layout(result, samples, ref, name)
        for kind in ("r2", "r3"):
            got, want = result[kind][0], single[kind][0]
            assert abs(got["loss"] - want["loss"]) < 1e-5, f"{name} {kind}: loss {got['loss']} vs {want['loss']}"
            rel = abs(got["grad_norm"] - want["grad_norm"]) / max(want["grad_norm"], 1e-12)
            assert rel < 1e-4, f"{name} {kind}: grad norm {got['grad_norm']} vs {want['grad_norm']}"
    return errors


def check_conversion_round_trip(model_dir: Path, tmp: Path) -> None:
    """HF -> Megatron distributed checkpoint -> HF gives every tensor of the checkpoint back bitwise (tensors the
    family does not use, such as MTP layers, included)."""
    from megatron_rl.megatron_backend.weights.conversion import hf_to_megatron, megatron_to_hf
    from megatron_rl.megatron_backend.weights.hf_weights import SafetensorsIndex

    hf_to_megatron(model_dir, tmp / "megatron")
    megatron_to_hf(tmp / "megatron", tmp / "hf")
    before, after = SafetensorsIndex(model_dir), SafetensorsIndex(tmp / "hf")
    assert after.names() == before.names(), sorted(after.names() ^ before.names())[:5]
    for name in sorted(before.names()):
        assert torch.equal(after.get(name), before.get(name)), f"{name} changed in the round trip"
