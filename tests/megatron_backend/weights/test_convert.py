"""Checkpoint conversion: HF -> Megatron -> HF is bitwise, converted checkpoints score like transformers in any
layout, trained checkpoints export to HF, and bad inputs are refused naming the field and both values."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.megatron_backend.weights import conversion
from megatron_rl.megatron_backend.weights.conversion import hf_to_megatron, megatron_to_hf
from tests.dist_harness import run_torchrun
from tests.hf_reference import hf_score, make_samples

CLI = [sys.executable, "-m", "megatron_rl.cli"]
REPO = Path(__file__).parents[3]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture
def cases(tiny_moe_dir: Path, tiny_moe_variants: dict, other_families: dict) -> dict[str, Path]:
    return {"qwen3_mixed_dense_untied": tiny_moe_dir, **tiny_moe_variants, **other_families}


@pytest.mark.parametrize(
    "case",
    ["qwen3_mixed_dense_untied", "tied_no_norm_topk", "sparse_step2", "gqa4_top4", "qwen2_moe", "qwen2_moe_tied",
     "mixtral"],
)  # fmt: skip
def test_hf_megatron_hf_round_trip_is_bitwise(case: str, cases: dict, tmp_path: Path) -> None:
    source = cases[case]
    report = hf_to_megatron(source, tmp_path / "megatron")
    assert report.tensors > 0 and (tmp_path / "megatron" / "COMPLETE").is_file()
    megatron_to_hf(tmp_path / "megatron", tmp_path / "hf")
    before, after = _weights(source), _weights(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == {**json.loads((source / "config.json").read_text()), "torch_dtype": config["torch_dtype"]}
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / extra).is_file():
            assert (tmp_path / "hf" / extra).read_bytes() == (source / extra).read_bytes(), extra


def test_bf16_storage_round_trip(tiny_moe_dir: Path, tmp_path: Path) -> None:
    hf_to_megatron(tiny_moe_dir, tmp_path / "megatron", dtype="bf16")
    megatron_to_hf(tmp_path / "megatron", tmp_path / "hf", dtype="bf16")
    after = _weights(tmp_path / "hf")
    for name, tensor in _weights(tiny_moe_dir).items():
        assert torch.equal(after[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _logprobs(checkpoint: Path, samples: list[dict], tmp: Path, nproc: int = 1, extra: tuple[str, ...] = ()):
    inp, out = tmp / "in.jsonl", tmp / f"out{nproc}{'_'.join(extra)}.jsonl"
    inp.write_text("".join(json.dumps(s) + "\n" for s in samples))
    args = ["logprobs", "--checkpoint", str(checkpoint), "--input", str(inp), "--output", str(out), *extra]
    if nproc == 1:
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        run_torchrun(REPO / "megatron_rl" / "cli.py", nproc, args)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _worst(got: list[dict], ref: list[dict]) -> float:
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        worst = max(worst, (torch.tensor(g["log_probs"], dtype=torch.float64) - r["log_probs"]).abs().max().item())
        same = torch.equal(torch.tensor(g["routed_experts"]).sort(-1).values, r["routed_experts"].sort(-1).values)
        assert same, "top-k experts differ from transformers"
    return worst


@pytest.mark.torchrun
@pytest.mark.parametrize(
    ("case", "nproc", "layout"),
    [
        ("qwen3_mixed_dense_untied", 4, ("--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1")),
        ("mixtral", 4, ("--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1")),
        ("qwen2_moe", 2, ("--tp", "2", "--ep", "2", "--etp", "1")),  # 3 layers: no even pipeline split
    ],
)
def test_converted_checkpoint_matches_transformers_at_tp1_and_tp2_pp2_ep2(case, nproc, layout, cases, tmp_path):
    source = cases[case]
    hf_to_megatron(source, tmp_path / "megatron")
    samples = make_samples(vocab=128, n=3, seed=11)
    ref = hf_score(source, samples)
    assert _worst(_logprobs(tmp_path / "megatron", samples, tmp_path), ref) < 1e-4
    assert _worst(_logprobs(tmp_path / "megatron", samples, tmp_path, nproc, layout), ref) < 1e-4


@pytest.mark.torchrun
def test_rl_trained_checkpoint_exports_to_hf(tiny_moe_dir: Path, trained_actor_checkpoint, tmp_path: Path) -> None:
    """A checkpoint trained (EP=2, 2 ranks) and saved by the trainer's checkpoint code, exported to HF:
    transformers on the export scores like the trainer's own model loaded from the checkpoint."""
    ckpt = trained_actor_checkpoint(2, ("--ep", "2")).ckpt  # shared with the checkpoint tests; only read here
    proc = subprocess.run([*CLI, "convert", "megatron-to-hf", str(ckpt), str(tmp_path / "hf"), "--hf-extras",
                           str(tiny_moe_dir), "--expect-config", str(tiny_moe_dir)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensors" in proc.stdout and "GB/s" in proc.stdout
    changed = [n for n, t in _weights(tmp_path / "hf").items() if not torch.equal(t, _weights(tiny_moe_dir)[n])]
    assert changed, "training changed no weight: the export did not read the trained checkpoint"
    samples = make_samples(vocab=128, n=3, seed=12)
    assert _worst(_logprobs(ckpt, samples, tmp_path), hf_score(tmp_path / "hf", samples)) < 1e-4


# ---------------------------------------------------------------------------------------------- bad inputs
def _copy_with_config(source: Path, dest: Path, **changes) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.same_on_every_megatron  # the HF config is checked against the weights before Megatron
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"vocab_size": 256}, "vocab_size=256 but"),
        pytest.param({"hidden_size": 96}, "hidden_size=96 but", marks=pytest.mark.slow),
        ({"tie_word_embeddings": True}, "tie_word_embeddings=True but the checkpoint has lm_head.weight"),
        pytest.param({"num_experts": 4}, "has 4 experts per layer", marks=pytest.mark.slow),
        pytest.param({"moe_intermediate_size": 48}, "moe_intermediate_size=48", marks=pytest.mark.slow),
    ],
)
def test_hf_config_that_does_not_fit_the_weights_is_refused(tiny_moe_dir: Path, tmp_path: Path, change, expected):
    bad = _copy_with_config(tiny_moe_dir, tmp_path / "bad", **change)
    proc = subprocess.run([*CLI, "convert", "hf-to-megatron", str(bad), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_megatron_checkpoint_of_another_architecture_is_refused(
    tiny_moe_dir: Path, tiny_moe_variants: dict, tmp_path: Path
) -> None:
    hf_to_megatron(tiny_moe_dir, tmp_path / "megatron")
    top4 = _copy_with_config(tiny_moe_dir, tmp_path / "top4", num_experts_per_tok=4)
    with pytest.raises(ValueError, match="num_experts_per_tok=2 but the model was built with num_experts_per_tok=4"):
        megatron_to_hf(tmp_path / "megatron", tmp_path / "hf", expect_config=top4)
    # hf_config.json swapped for another architecture's: the stored tensors do not fit it.
    other = json.loads((tiny_moe_variants["gqa4_top4"] / "config.json").read_text())
    (tmp_path / "megatron" / "hf_config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="does not hold the architecture"):
        megatron_to_hf(tmp_path / "megatron", tmp_path / "hf2")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf2").exists()
    with pytest.raises(ValueError, match="no complete checkpoint"):
        megatron_to_hf(tmp_path, tmp_path / "hf3")


def test_interrupted_conversion_leaves_no_output_and_refuses_to_overwrite(
    tiny_moe_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    calls = {"n": 0}
    original = conversion._HFTensorSource.materialize

    def dying(self, meta):
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("simulated crash mid-write")
        return original(self, meta)

    monkeypatch.setattr(conversion._HFTensorSource, "materialize", dying)
    with pytest.raises(RuntimeError, match="simulated crash"):
        hf_to_megatron(tiny_moe_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(conversion._HFTensorSource, "materialize", original)
    hf_to_megatron(tiny_moe_dir, tmp_path / "out")  # the stale temporary directory is replaced
    assert not (tmp_path / ".tmp_out").exists()
    with pytest.raises(ValueError, match="exists and is not empty"):
        hf_to_megatron(tiny_moe_dir, tmp_path / "out")
