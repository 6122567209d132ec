"""LoRA in the RL loop (`model.lora`): the local engine receives the merged weights (trainer/engine log-probs agree
as without adapters), the first update is exactly on-policy, the KL reference is the base with the adapters off, and
a run resumed from its adapter-only checkpoint continues bitwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.shared_runs import EXAMPLE, WarmedModel

IGNORED = ("time/", "perf/", "sync/bytes", "sync/tensors", "sync/full_syncs")  # a start's first sync sends all


def _train(out: Path, model: Path, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
               f"model.hf_path={model}", "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0",
               "logging.plot=false", "model.lora.rank=8", "algo.kl_coef=0.01", "trainer.save_every=2",
               *overrides]  # fmt: skip
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
    # After the first sync only the adapted tensors go (their merged weights), and the engine still scores as the
    # trainer (`mismatch/logp_abs_diff` above); the resumed start sends everything once.
    assert [r["sync/full_syncs"] for r in straight] == [1, 0, 0, 0] and [r["sync/full_syncs"] for r in resumed][2] == 1
    full_and_partial, partial = straight[0]["sync/bytes"], straight[1]["sync/bytes"]  # step 1 also holds the start's
    assert resumed[2]["sync/bytes"] == full_and_partial and full_and_partial - partial > partial
    from tests.megatron_backend.lora.test_lora_checkpoint import _model_keys

    keys = _model_keys(tmp_path / "straight" / "checkpoints" / "step_000000004" / "megatron")
    assert keys and all(".lora." in k for k in keys if k.startswith("decoder.")), sorted(keys)[:5]  # no base weight


def test_a_lora_checkpoint_converts_to_a_peft_adapter_and_a_merged_model(warmed_demo: WarmedModel, tmp_path: Path):
    """`megatron-rl convert lora-to-hf`: peft loads the adapter on the base and scores as the merged model does;
    the streaming `megatron-to-hf` refuses the adapter-only checkpoint naming the command to use; a run started
    from the adapter (`model.lora.init_from`) evaluates as the run that wrote it did at that step, and its KL
    reference is that adapter (`actor/kl_ref` of its first, on-policy update is 0)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = warmed_demo.warmed
    evaluated = ("data.eval=synthetic", "data.eval_every=2", "data.eval_prompts=64")
    written = _train(tmp_path / "run", model, "trainer.steps=2", *evaluated)
    step = tmp_path / "run" / "checkpoints"
    convert = [sys.executable, "-m", "megatron_rl.cli", "convert"]
    proc = subprocess.run([*convert, "lora-to-hf", str(step), str(tmp_path / "adapter"), "--merged",
                           str(tmp_path / "merged")], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = subprocess.run([*convert, "megatron-to-hf", str(step), str(tmp_path / "hf")], capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert refused.returncode != 0 and "megatron-rl convert lora-to-hf" in refused.stderr, refused.stderr[-2000:]

    ids = torch.tensor([[5, 9, 12, 7, 30, 41, 8, 3, 11, 19]])

    def log_probs(m) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(m(ids).logits[0].double(), -1)

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    plain = log_probs(base)
    adapted = log_probs(PeftModel.from_pretrained(base, tmp_path / "adapter"))
    merged = log_probs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32))
    assert (adapted - merged).abs().max() < 1e-5
    assert (adapted - plain).abs().max() > 1e-4  # two RL steps moved the adapters
    started = _train(tmp_path / "continued", model, "trainer.steps=1", "algo.mini_batches_per_step=1",
                     f"model.lora.init_from={tmp_path / 'adapter'}", *evaluated)  # fmt: skip
    assert written[0]["eval/accuracy"] != written[-1]["eval/accuracy"]  # measured: 0.672 at step 0, 0.656 at 2
    assert started[0]["eval/accuracy"] == written[-1]["eval/accuracy"]
    assert started[1]["actor/kl_ref"] == 0.0 and started[1]["actor/ppo_kl_first"] == 0.0
