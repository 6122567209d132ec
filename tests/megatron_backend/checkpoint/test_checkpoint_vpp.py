"""A trained checkpoint loads into a virtual-pipeline layout (PP=2 x VPP=2: one layer per model chunk)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.commands.test_logprobs_cli import _score
from tests.dist_harness import run_torchrun
from tests.hf_reference import make_samples
from tests.megatron_backend.weights.test_convert import _logprobs

SCRIPT = Path(__file__).parent / "scripts" / "checkpoint_check.py"
pytestmark = pytest.mark.torchrun


def _largest_gap(a: list[dict], b: list[dict]) -> float:
    """The largest per-token log-prob difference between two scorings of the same samples."""
    return max(
        abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x["log_probs"], y["log_probs"], strict=True)
    )


def test_trained_checkpoint_loads_into_pp2_vpp2(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """Written by the trainer's checkpoint code in one process, scored at PP=2 x VPP=2: the same log-probs
    (fp32 tolerance) and routes as scored in one process, and not the initial model's."""
    ckpt = tmp_path / "ckpt"
    run_torchrun(SCRIPT, 1, ["--model", str(tiny_moe_dir), "--ckpt", str(ckpt), "--out", str(tmp_path / "run.json"),
                             "--phase", "full"])  # fmt: skip
    samples = make_samples(vocab=128, n=4, seed=13)
    single = _logprobs(ckpt, samples, tmp_path)
    # The 4 samples fit one micro-batch of the default budget; the interleaved schedule needs at least PP=2,
    # which the actor makes by splitting (micro_batches.micro_batch_count).
    chunked = _logprobs(ckpt, samples, tmp_path, 2, ("--pp", "2", "--vpp", "2"))
    assert _largest_gap(single, chunked) < 5e-6
    for x, y in zip(single, chunked, strict=True):  # the order inside a top-k row carries no meaning
        assert torch.equal(
            torch.tensor(x["routed_experts"]).sort(-1).values, torch.tensor(y["routed_experts"]).sort(-1).values
        )
    (tmp_path / "initial").mkdir()
    initial = _score(tiny_moe_dir, samples, tmp_path / "initial")
    assert _largest_gap(single, initial) > 1e-3, "the checkpoint scores like the initial model"
