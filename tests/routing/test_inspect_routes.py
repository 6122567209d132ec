"""tools/inspect_routes.py on a saved .pt batch and on two logprobs JSONL files."""

import json
import subprocess
import sys
from pathlib import Path

import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "inspect_routes.py"


def test_pt_and_jsonl(tmp_path: Path) -> None:
    sys.path.insert(0, str(TOOL.parent))
    from inspect_routes import save_routes

    a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]]])  # [1, 3, 2, 2]
    b = torch.tensor([[[[1, 0], [3, 2]], [[0, 1], [7, 6]], [[5, 6], [5, 6]]]])
    save_routes(tmp_path / "r.pt", a, b, torch.tensor([3]), names=("recorded", "natural"), layers=[0, 2])
    out = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path / "r.pt"), "--png", str(tmp_path / "a.png")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    # the last token (position 2) has no route in the SGLang layout: 2 tokens compared
    assert "recorded vs natural: 2 tokens" in out.stdout
    assert "0.7500" in out.stdout and "layer   2  1.0000" in out.stdout
    assert (tmp_path / "a.png").stat().st_size > 0
    for name, r in (("x", a), ("y", b)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"routed_experts": r[0, :2].tolist()}) + "\n")
    out = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path / "x.jsonl"), str(tmp_path / "y.jsonl")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "agreement (token, layer, slot)  0.7500" in out.stdout
