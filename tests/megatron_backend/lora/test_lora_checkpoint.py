"""Adapter-only checkpoints (`lora/checkpoint.py`): a LoRA run's checkpoint holds the adapters and their optimizer
state, not the frozen base; it resumes exactly (TP=2 with sequence parallelism and expert TP=2, where adapters are
split) and its adapters load into another layout (TP=2 saved, one process scores as TP=2 did)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_runs import checkpoint_phase

pytestmark = pytest.mark.torchrun
LORA = ("--lora-rank", "4")


def _model_keys(step_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k for k in keys if not k.startswith("optimizer")}


def test_a_lora_checkpoint_holds_only_adapters_resumes_exactly_and_loads_into_another_layout(
    tiny_moe_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    tp2 = ("--tp", "2", *LORA)
    full = checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "full.json", "full", 2, tp2)
    keys = _model_keys(ckpt / "step_000000002" / "megatron")
    tensors = {k for k in keys if ".lora." in k}
    assert tensors and not [k for k in keys if k.startswith("decoder.") and ".lora." not in k], sorted(keys)[:5]
    resumed = checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "resume.json", "resume", 2, tp2)
    assert resumed["steps"] == full["steps"]
    assert full["steps"][0]["loss"] != full["steps"][1]["loss"]
    scored = {
        n: checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / f"score{n}.json", "score", n, e)["log_probs"]
        for n, e in ((2, tp2), (1, LORA))
    }
    worst = max(abs(a - b) for ra, rb in zip(scored[1], scored[2], strict=True) for a, b in zip(ra, rb, strict=True))
    assert worst < 5e-6
