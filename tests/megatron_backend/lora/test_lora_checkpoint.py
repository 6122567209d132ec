"""Adapter-only checkpoints (`lora/checkpoint.py`): a LoRA run's checkpoint holds the adapters and their optimizer
state, not the frozen base; it resumes exactly and its adapters load into another layout (saved in two processes,
one process scores as they did). Two layouts: TP=2 with sequence parallelism and expert TP=2, where adapters are
split; EP=2 with an A shared by each layer's experts (`share_expert_a`), held once per layer and replicated on both
expert-parallel ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_runs import checkpoint_phase

pytestmark = pytest.mark.torchrun
LORA = ("--lora-rank", "4")
SHARED_A = "--lora-share-expert-a"


def _model_keys(step_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k for k in keys if not k.startswith("optimizer")}


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--ep", "2", SHARED_A)], ids=["tp2", "ep2_shared_a"])
def test_a_lora_checkpoint_holds_only_adapters_resumes_exactly_and_loads_into_another_layout(
    tiny_moe_dir: Path, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    ckpt = tmp_path / "ckpt"
    two = (*layout, *LORA)
    one = (*LORA, *[a for a in layout if a == SHARED_A])
    full = checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "full.json", "full", 2, two)
    keys = _model_keys(ckpt / "step_000000002" / "megatron")
    tensors = {k for k in keys if ".lora." in k}
    assert tensors and not [k for k in keys if k.startswith("decoder.") and ".lora." not in k], sorted(keys)[:5]
    shared = {k for k in tensors if ".mlp.lora." in k}  # the experts' shared A: one fc1 and one fc2 per MoE layer
    assert len(shared) == (2 * 3 if SHARED_A in layout else 0)
    resumed = checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / "resume.json", "resume", 2, two)
    assert resumed["steps"] == full["steps"]
    assert full["steps"][0]["loss"] != full["steps"][1]["loss"]
    scored = {
        n: checkpoint_phase(tiny_moe_dir, ckpt, tmp_path / f"score{n}.json", "score", n, e)["log_probs"]
        for n, e in ((2, two), (1, one))
    }
    worst = max(abs(a - b) for ra, rb in zip(scored[1], scored[2], strict=True) for a, b in zip(ra, rb, strict=True))
    assert worst < 5e-6
