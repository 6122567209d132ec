"""LoRA in the RL loop (`model.lora`): the local engine receives the merged weights (trainer/engine log-probs agree
as without adapters), the first update is exactly on-policy, the KL reference is the base with the adapters off, and
a run resumed from its adapter-only checkpoint continues bitwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.shared_runs import EXAMPLE, WarmedModel

IGNORED = ("time/", "perf/")


def _train(out: Path, model: Path, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
               f"model.hf_path={model}", "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0",
               "logging.plot=false", "model.lora.rank=8", "algo.kl_coef=0.01", "trainer.save_every=2", *overrides]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_trains_on_policy_against_the_base_and_resumes_bitwise(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    model = warmed_demo.warmed  # rewards vary, so the adapters move
    straight = _train(tmp_path / "straight", model, "trainer.steps=4")
    _train(tmp_path / "resumed", model, "trainer.steps=2")
    resumed = _train(tmp_path / "resumed", model, "trainer.steps=4", "trainer.resume=auto")
    assert [r["step"] for r in straight] == [1, 2, 3, 4] == [r["step"] for r in resumed]
    for a, b in zip(straight, resumed, strict=True):
        assert a["actor/ppo_kl_first"] == 0.0 and a["mismatch/logp_abs_diff"] < 1e-5
        same = [k for k in a if not k.startswith(IGNORED) and k != "actor/ppo_kl_first_checked"]
        assert {k: a[k] for k in same} == {k: b[k] for k in same}, a["step"]
    assert straight[0]["actor/kl_ref"] >= 0 and straight[-1]["actor/kl_ref"] > 0  # the adapters moved off the base
    from tests.megatron_backend.lora.test_lora_checkpoint import _model_keys

    keys = _model_keys(tmp_path / "straight" / "checkpoints" / "step_000000004" / "megatron")
    assert keys and all(".lora." in k for k in keys if k.startswith("decoder.")), sorted(keys)[:5]  # no base weight
