"""SFT on the user's data end to end: the warm-up on a GSM8K-format JSONL lowers its loss and RL follows in the
same run; a run killed mid-SFT resumes mid-SFT with the same losses; `megatron-rl sft` writes a loadable HF model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from megatron_rl.trainer.warmup import SFT_METRICS, SFT_PLOT
from tests.shared_runs import DEMO_SEED

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "tiny_gsm8k_sft_grpo.yaml"
CLI = [sys.executable, "-m", "megatron_rl.cli"]
KILLED = [sys.executable, str(Path(__file__).parent / "scripts" / "train_killed_mid_sft.py")]
# The example, shortened: 8 SFT steps of 16 examples, a mid-SFT checkpoint every 2, then 2 small GRPO steps.
SHORT = [
    "warmup.sft_steps=8",
    "warmup.sft_batch_size=16",
    "trainer.steps=2",
    "warmup.save_every=2",
    "rollout.n_samples=4",
    "rollout.prompts_per_step=4",
    "data.eval=null",
    "data.eval_every=0",
    "logging.wandb=false",
    "logging.plot=true",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("sft_model") / "model", seed=DEMO_SEED)


def _run(command: list[str], out: Path, model: Path, *overrides: str, env: dict | None = None, check: bool = True):
    """The example through `command`, shortened (SHORT), in a session of its own (the killed run kills its group)."""
    proc = subprocess.run(
        [*command, str(EXAMPLE), f"trainer.output_dir={out}", f"model.hf_path={model}", *SHORT, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,  # the example names its data relative to the repository
        env=env,
        start_new_session=True,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _sft_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / SFT_METRICS).read_text().splitlines()]


def _rl_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft_then_rl") / "run"
    _run([*CLI, "train"], out, model_dir)
    return out


def test_sft_on_user_jsonl_lowers_the_loss_then_rl_runs(uninterrupted: Path):
    rows = _sft_rows(uninterrupted)
    assert [r["sft_step"] for r in rows] == list(range(1, 9))
    first, last = rows[0]["sft/nll"], rows[-1]["sft/nll"]
    # A random model starts near ln(128) = 4.85 nats per token; 8 steps at lr 2e-3 reach ~2.4 (a sign-flipped or
    # zeroed loss stays at or above the start).
    assert first > 4.0 and last < first - 1.5, (first, last)
    assert all(r["sft/tokens"] > 16 * 10 for r in rows)  # "a + b = c\n#### c" + EOS per example, nothing else
    assert (uninterrupted / SFT_PLOT).is_file()
    assert (uninterrupted / "warmup_model" / "config.json").is_file()
    rl = _rl_rows(uninterrupted)
    assert [r["step"] for r in rl] == [1, 2]
    assert all(math.isfinite(r["actor/loss"]) and 0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rl)


def test_a_run_stopped_and_killed_mid_sft_resumes_mid_sft(uninterrupted: Path, model_dir: Path, tmp_path: Path):
    """Ctrl-C during SFT step 3 (it stops after it, saving there), then a resume SIGKILLed before step 6 (the
    checkpoint of step 4 is the newest), then a resume to the end: the rows are the uninterrupted run's."""
    out = tmp_path / "run"

    def sft_state() -> dict:
        return json.loads((out / "checkpoints" / "step_000000000" / "trainer_state.json").read_text())["trainer"]

    env = {**os.environ, "STOP_AT_CALL": "3", "STOP_SIGNAL": "INT"}
    stopped = _run([*KILLED, "train"], out, model_dir, env=env, check=False)
    assert stopped.returncode == 130, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "interrupted at SFT step 3 of 8; last checkpoint: SFT step 3; resume with: " in stopped.stdout
    assert [r["sft_step"] for r in _sft_rows(out)] == [1, 2, 3] and sft_state()["sft_step"] == 3

    env = {**os.environ, "STOP_AT_CALL": "3", "STOP_SIGNAL": "KILL"}  # the 3rd step of this start: step 6
    killed = _run([*KILLED, "train"], out, model_dir, "trainer.resume=auto", env=env, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [r["sft_step"] for r in _sft_rows(out)] == [1, 2, 3, 4, 5]  # step 5 ran after the checkpoint of step 4
    assert sft_state()["sft_step"] == 4 and sft_state()["sft_done"] is False
    assert not (out / "metrics.jsonl").is_file() or not _rl_rows(out)  # no RL step yet

    _run([*CLI, "train"], out, model_dir, "trainer.resume=auto")
    resumed, expected = _sft_rows(out), _sft_rows(uninterrupted)
    assert [r["sft_step"] for r in resumed] == list(range(1, 9))
    for got, want in zip(resumed, expected, strict=True):
        assert got["sft/nll"] == pytest.approx(want["sft/nll"], rel=1e-5, abs=1e-6), got["sft_step"]
    # RL then starts from the same warmed-up model: its rows are the uninterrupted run's.
    for got, want in zip(_rl_rows(out), _rl_rows(uninterrupted), strict=True):
        assert got["rollout/reward_mean"] == pytest.approx(want["rollout/reward_mean"], abs=1e-6)
        assert got["actor/loss"] == pytest.approx(want["actor/loss"], rel=1e-4, abs=1e-6)


def test_sft_command_writes_a_loadable_hf_model(model_dir: Path, tmp_path: Path):
    """`megatron-rl sft` on TRL's conversational format (a `messages` column, two assistant turns per row)."""
    rows = [json.loads(line) for line in (ROOT / "examples/data/tiny_gsm8k/train.jsonl").read_text().splitlines()]
    chats = tmp_path / "chats.jsonl"
    with chats.open("w") as f:
        for a, b in zip(rows[0::2][:200], rows[1::2][:200], strict=True):
            turns = [
                {"role": role, "content": row[key]}
                for row in (a, b)
                for role, key in (("user", "question"), ("assistant", "answer"))
            ]
            f.write(json.dumps({"messages": turns}) + "\n")
    out = tmp_path / "sft"
    proc = _run([*CLI, "sft"], out, model_dir, f"warmup.data={chats}")
    saved = out / "warmup_model"
    assert f"SFT model: {saved}" in proc.stdout
    assert not (out / "metrics.jsonl").exists()  # no RL step

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.rollout.sft_data import SFTDataset

    tokenizer = AutoTokenizer.from_pretrained(saved)
    data = SFTDataset.from_file(
        chats, tokenizer, prompt_key="question", response_key="answer", apply_chat_template=True, seed=0
    )

    def nll(path: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for pair in data.sft_pairs(32):
                ids = torch.tensor([pair.prompt_ids + pair.response_ids])
                logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
                targets = ids[0, 1:]
                mask = torch.tensor([0] * (len(pair.prompt_ids) - 1) + pair.loss_mask, dtype=torch.float)
                total -= float((logp.gather(1, targets[:, None])[:, 0] * mask).sum())
                count += int(mask.sum())
        return total / count

    before, after = nll(model_dir), nll(saved)
    last = _sft_rows(out)[-1]["sft/nll"]
    assert before > 4.0 and after < before - 1.5, (before, after)
    assert after == pytest.approx(last, abs=0.5)  # the HF model scores as the warm-up's last steps did


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1234, 1, 2])
def test_the_gsm8k_example_sft_then_grpo_raises_held_out_accuracy(tmp_path: Path, seed: int):
    """The whole example (300 SFT steps, 60 GRPO steps, 256 held-out problems): the warm-up gives a partly-right
    model and GRPO with the gsm8k reward raises its greedy accuracy. Measured 2026-12-02 on 2 CPU cores (seeds
    1234 / 1 / 2): 0.473 / 0.590 / 0.566 -> 0.684 / 0.801 / 0.754, rises 0.19-0.21 on this CPU's kernels; seed 1234
    on the avx2 / no-SIMD kernels rose 0.141 / 0.102 (docs/testing.md). The bound 0.04 is under half of the smallest,
    and a zeroed RL loss keeps the warmed-up model's greedy accuracy exactly (rise 0; sign-flipped: 0.47 -> 0.04)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [*CLI, "train", str(EXAMPLE), f"trainer.output_dir={out}", f"model.hf_path={tmp_path / 'model'}",
         f"trainer.seed={seed}", "logging.plot=false"],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    accuracy = [r["eval/accuracy"] for r in _rl_rows(out) if "eval/accuracy" in r]
    assert 0.25 <= accuracy[0] <= 0.8, accuracy  # after SFT: partly right
    assert accuracy[-1] >= accuracy[0] + 0.04, accuracy


def test_a_row_without_a_response_is_refused_before_the_model_build(model_dir: Path, tmp_path: Path):
    data = tmp_path / "no_response.jsonl"
    data.write_text(json.dumps({"question": "Tom has 3 apples.", "answer": "3\n#### 3"}) + "\n"
                    + json.dumps({"question": "Ann has 2 pens."}) + "\n")  # fmt: skip
    proc = _run([*CLI, "train"], tmp_path / "run", model_dir, f"warmup.data={data}", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"megatron-rl train: error: {data}:2: the conversation ends in 'user' turn, not an assistant turn" in (
        proc.stderr
    )
    assert "supervised warm-up" not in proc.stderr  # refused before the model was built and trained
