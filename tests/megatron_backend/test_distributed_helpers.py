"""The collective helpers of `megatron_backend/distributed.py` under torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_harness import run_torchrun


@pytest.mark.torchrun
def test_rank0s_decision_and_its_refusal_reach_every_rank(tmp_path: Path) -> None:
    """`decided_on_rank0` (how a start uses output_dir): only rank 0 decides; every rank gets its value, and its
    ValueError with rank 0's message, so all ranks stop alike."""
    script = Path(__file__).parent / "scripts" / "rank0_verdict_check.py"
    run_torchrun(script, 2, ["--out", str(tmp_path)], timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["ran"] for r in ranks] == [["decide", "refuse"], []]
    assert all(r["value"] == {"start_step": 7, "decided_by": 0} for r in ranks)
    assert all(r["error"] == "rank 0: output_dir holds another run; set trainer.overwrite=true" for r in ranks)
