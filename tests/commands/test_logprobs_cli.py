"""`megatron-rl logprobs` against Hugging Face transformers, replay of routes, and its input errors.

Tolerance (fp32): per-token log-probs and entropy within 1e-4 of transformers (measured ~1e-6);
every token's top-k experts per MoE layer identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import run_torchrun
from tests.hf_reference import assert_matches_hf, hf_score, make_samples

CLI = [sys.executable, "-m", "megatron_rl.cli", "logprobs"]


def _write(path: Path, samples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


def _score(model: Path, samples: list[dict], tmp: Path, *extra: str) -> list[dict]:
    inp = _write(tmp / "in.jsonl", samples)
    out = tmp / "out.jsonl"
    proc = subprocess.run(
        [*CLI, "--hf-model", str(model), "--input", str(inp), "--output", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("packing", ["on", "off"])
def test_logprobs_match_transformers(packing: str, tiny_moe_dir: Path, tmp_path: Path) -> None:
    """Packed (the default: several samples per micro-batch, THD) and padded scoring both match transformers."""
    samples = make_samples(vocab=128)
    got = _score(tiny_moe_dir, samples, tmp_path, "--packing", packing, "--micro-batch-tokens", "64")
    assert_matches_hf(got, hf_score(tiny_moe_dir, samples))


@pytest.mark.parametrize(
    "variant", ["tied_no_norm_topk", pytest.param("sparse_step2", marks=pytest.mark.slow), "gqa4_top4"]
)
def test_logprobs_match_transformers_variants(variant: str, tiny_moe_variants: dict, tmp_path: Path) -> None:
    model = tiny_moe_variants[variant]
    samples = make_samples(vocab=128, n=3, seed=1)
    got = _score(model, samples, tmp_path)
    assert_matches_hf(got, hf_score(model, samples))


# qwen2_moe_tied covers Qwen2-MoE (shared expert, tied embeddings); Mixtral and untied Qwen2-MoE at TP2xEP2 below
@pytest.mark.parametrize(
    "family",
    [
        pytest.param("qwen2_moe", marks=pytest.mark.slow),
        "qwen2_moe_tied",
        pytest.param("mixtral", marks=pytest.mark.slow),
    ],
)
def test_other_families_match_transformers(family: str, other_families: dict, tmp_path: Path) -> None:
    model = other_families[family]
    samples = make_samples(vocab=128, n=3, seed=4)
    assert_matches_hf(_score(model, samples, tmp_path), hf_score(model, samples))


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "family", [pytest.param("qwen2_moe", marks=pytest.mark.slow), "mixtral"]
)  # Qwen2-MoE at TP2xEP2: tests/megatron_backend/weights
def test_other_families_tp2_ep2(family: str, other_families: dict, tmp_path: Path) -> None:
    model = other_families[family]
    samples = make_samples(vocab=128, n=3, seed=5)
    ref = hf_score(model, samples)
    inp = _write(tmp_path / "in.jsonl", samples)
    out = tmp_path / "out.jsonl"
    run_torchrun(
        Path(__file__).parents[2] / "megatron_rl" / "cli.py",
        2,
        [
            "logprobs",
            "--hf-model",
            str(model),
            "--input",
            str(inp),
            "--output",
            str(out),
            "--tp",
            "2",
            "--ep",
            "2",
            "--etp",
            "1",
        ],
    )
    assert_matches_hf([json.loads(line) for line in out.read_text().splitlines()], ref)


@pytest.mark.torchrun
def test_logprobs_cli_under_torchrun_tp2_ep2(tiny_moe_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(vocab=128, n=4, seed=2)
    ref = hf_score(tiny_moe_dir, samples)
    inp = _write(tmp_path / "in.jsonl", samples)
    for name, extra in {"tp2": ["--tp", "2"], "ep2": ["--ep", "2"]}.items():
        out = tmp_path / f"{name}.jsonl"
        run_torchrun(
            Path(__file__).parents[2] / "megatron_rl" / "cli.py",
            2,
            ["logprobs", "--hf-model", str(tiny_moe_dir), "--input", str(inp), "--output", str(out), *extra],
        )
        assert_matches_hf([json.loads(line) for line in out.read_text().splitlines()], ref)


def test_replay_routes_reproduces_recording_and_catches_misalignment(tiny_moe_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(vocab=128, n=3, seed=3)
    recorded = _score(tiny_moe_dir, samples, tmp_path)
    replayed = _score(tiny_moe_dir, recorded, tmp_path, "--replay-routes")
    for a, b in zip(recorded, replayed, strict=True):
        assert a["log_probs"] == b["log_probs"], "replaying the recorded routes must reproduce log-probs bitwise"
    # Shift every sample's routes by one position: a classic off-by-one. Log-probs must change.
    shifted = []
    for s in recorded:
        routes = s["routed_experts"]
        shifted.append({**s, "routed_experts": routes[1:] + routes[-1:]})
    moved = _score(tiny_moe_dir, shifted, tmp_path, "--replay-routes")
    diff = max(
        max(abs(x - y) for x, y in zip(a["log_probs"], b["log_probs"], strict=True))
        for a, b in zip(recorded, moved, strict=True)
    )
    assert diff > 1e-3, "misaligned routes went unnoticed"


def _fail(args: list[str]) -> str:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    return proc.stderr


@pytest.mark.same_on_every_megatron  # refused before a model is built
def test_rejects_tokens_outside_vocabulary(tiny_moe_dir: Path, tmp_path: Path) -> None:
    inp = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 500], "response_start": 1}])
    err = _fail(["--hf-model", str(tiny_moe_dir), "--input", str(inp), "--output", str(tmp_path / "o")])
    assert "outside the model's vocabulary of 128" in err


@pytest.mark.same_on_every_megatron  # refused before a model is built
def test_rejects_unsupported_architecture(tiny_moe_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "llama"
    model.mkdir()
    config = json.loads((tiny_moe_dir / "config.json").read_text())
    config["model_type"] = "llama"
    (model / "config.json").write_text(json.dumps(config))
    inp = _write(tmp_path / "in.jsonl", make_samples(128, n=1))
    err = _fail(["--hf-model", str(model), "--input", str(inp), "--output", str(tmp_path / "o")])
    assert "unsupported architecture" in err and "model_type='llama'" in err and "qwen3_moe" in err


def test_rejects_checkpoint_that_does_not_match_config(tiny_moe_dir: Path, tiny_moe_variants: dict, tmp_path: Path):
    # config.json of one model, weights of another (different head layout).
    model = tmp_path / "mismatch"
    model.mkdir()
    (model / "config.json").write_text((tiny_moe_dir / "config.json").read_text())
    (model / "model.safetensors").write_bytes((tiny_moe_variants["gqa4_top4"] / "model.safetensors").read_bytes())
    inp = _write(tmp_path / "in.jsonl", make_samples(128, n=1))
    err = _fail(["--hf-model", str(model), "--input", str(inp), "--output", str(tmp_path / "o")])
    assert "does not match the config" in err or "different architectures" in err


@pytest.mark.same_on_every_megatron  # refused before a model is built
def test_rejects_invalid_layout(tiny_moe_dir: Path, tmp_path: Path) -> None:
    inp = _write(tmp_path / "in.jsonl", make_samples(128, n=1))
    err = _fail(["--hf-model", str(tiny_moe_dir), "--input", str(inp), "--output", str(tmp_path / "o"), "--tp", "2"])
    assert "world size" in err.lower()
