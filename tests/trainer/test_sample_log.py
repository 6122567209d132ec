"""Seeing the samples: samples.jsonl / eval_samples.jsonl rows of a real run on chat data (prompt as the chat
template rendered it, response as the reward read it, reward and its parts), cut back on resume; the console
excerpt; the wandb tables of an offline run; the mismatch plot's clamped k3 and its axes without offsets."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.config.schema import LoggingConfig
from megatron_rl.rollout.sample import Sample
from megatron_rl.tiny_model import build_char_tokenizer, make_tiny_qwen3_moe
from megatron_rl.trainer.logs.plots import figure, plot_series, series_of
from megatron_rl.trainer.logs.run_log import RunLog
from megatron_rl.trainer.logs.sample_log import (
    SampleLog,
    cut_back,
    format_samples,
    one_line,
    pick_samples,
    sample_rows,
)
from tests.shared_runs import DEMO_SEED, TRAIN


def text_code(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """A reward that names the text it read: CRC32 of `text` in [0, 1) (the run's second reward)."""
    return zlib.crc32(text.encode()) / 2**32


TEXT_CODE = "tests.trainer.test_sample_log:text_code"
STEPS, PER_STEP, SHOWN, EVAL_PROMPTS, MAX_NEW = 3, 5, 2, 4, 16
SYSTEM = "Reverse the digits."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_char_tokenizer()


def _messages(digits: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": digits}]


def _write_chat_rows(path: Path, digits: list[str]) -> Path:
    rows = [{"prompt": _messages(d), "answer": d[::-1], "data_source": "digits/reverse"} for d in digits]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(out: Path, model: Path, data: Path) -> subprocess.CompletedProcess:
    reward = f"[{{name: exact_match, weight: 2.0}}, {{name: '{TEXT_CODE}', weight: 0.5}}]"
    proc = subprocess.run(
        [*TRAIN, f"trainer.output_dir={out}", f"model.hf_path={model}", "warmup.sft_steps=0", "algo.preset=grpo",
         f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'held_out.jsonl'}", "data.eval_every=3",
         f"data.eval_prompts={EVAL_PROMPTS}", f"data.reward={reward}", "rollout.prompts_per_step=3",
         "rollout.n_samples=2", f"rollout.sampling.max_new_tokens={MAX_NEW}", f"trainer.steps={STEPS}",
         "trainer.save_every=1", "trainer.keep_last=0", f"logging.samples_per_step={PER_STEP}",
         f"logging.show_samples={SHOWN}", "logging.wandb=false", "logging.plot=false"],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, subprocess.CompletedProcess]:
    """A 3-step GRPO run of the random tiny model on chat-message JSONL (3 prompts x 2 samples a step), rewarded by
    exact_match (x2) + text_code (x0.5), evaluated at steps 0 and 3, a checkpoint after every step."""
    base = tmp_path_factory.mktemp("chat_run")
    model = make_tiny_qwen3_moe(base / "model", seed=DEMO_SEED)
    data = base / "data"
    data.mkdir()
    _write_chat_rows(data / "train.jsonl", ["4821", "907", "55312", "1234", "8080", "67"])
    _write_chat_rows(data / "held_out.jsonl", ["3141", "271", "16180", "42"])
    out = base / "run"
    return out, model, data, _train(out, model, data)


def test_samples_hold_the_templated_prompt_the_response_and_its_reward(chat_run, tokenizer) -> None:
    from megatron_rl.rollout.rewards.registry import exact_match

    out, _, _, _ = chat_run
    rows = _rows(out / "samples.jsonl")
    assert [r["step"] for r in rows] == [s for s in range(1, STEPS + 1) for _ in range(PER_STEP)]
    digits = {json.dumps(_messages(d)): d for d in ["4821", "907", "55312", "1234", "8080", "67"]}
    rendered = {tokenizer.apply_chat_template(json.loads(m), tokenize=False, add_generation_prompt=True): d
                for m, d in digits.items()}  # fmt: skip
    for row in rows:
        assert row["prompt"] in rendered, row["prompt"]  # the chat template applied, as the model saw it
        assert row["prompt"].endswith("<|im_start|>assistant\n") and SYSTEM in row["prompt"]
        assert row["answer"] == rendered[row["prompt"]][::-1] and row["data_source"] == "digits/reverse"
        # text_code names the text the reward read: the response is that text, decoded from the response ids
        assert row["reward/text_code"] == text_code(None, row["response"], {})  # type: ignore[arg-type]
        assert row["reward/exact_match"] == exact_match(None, row["response"], row)  # type: ignore[arg-type]
        assert row["reward"] == pytest.approx(2.0 * row["reward/exact_match"] + 0.5 * row["reward/text_code"])
        assert 1 <= row["length"] <= MAX_NEW and (row["finish_reason"] == "length") == (row["length"] == MAX_NEW)
        assert math.isfinite(row["advantage"])
    # Spread over the groups: sample 0 of groups 0, 1, 2, then sample 1 of groups 0, 1.
    assert [r["group"] for r in rows[:PER_STEP]] == [0, 1, 2, 0, 1]
    for step in range(1, STEPS + 1):  # GRPO: a group's two advantages are +-1 unless its rewards tie
        by_group: dict[int, list[dict]] = {}
        for r in rows:
            if r["step"] == step:
                by_group.setdefault(r["group"], []).append(r)
        for pair in (g for g in by_group.values() if len(g) == 2):
            a, b = pair
            if a["reward"] != b["reward"]:
                assert a["advantage"] == pytest.approx(-b["advantage"], abs=1e-5) and abs(a["advantage"]) > 0.5
                assert (a["advantage"] > 0) == (a["reward"] > b["reward"])


def test_eval_samples_hold_every_held_out_generation(chat_run, tokenizer) -> None:
    out, _, data, _ = chat_run
    rows = _rows(out / "eval_samples.jsonl")
    assert [r["step"] for r in rows] == [0] * EVAL_PROMPTS + [STEPS] * EVAL_PROMPTS
    held_out = [json.loads(line) for line in (data / "held_out.jsonl").read_text().splitlines()]
    expected = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in held_out
    ]
    for step in (0, STEPS):
        logged = [r for r in rows if r["step"] == step]
        assert [r["prompt"] for r in logged] == expected
        assert [r["answer"] for r in logged] == [r["answer"] for r in held_out]
        assert [r["group"] for r in logged] == list(range(len(held_out)))  # one greedy response per prompt
    for row in rows:
        assert row["dataset"] == "held_out" and row["data_source"] == "digits/reverse"
        assert row["reward/text_code"] == text_code(None, row["response"], {})  # type: ignore[arg-type]
        assert row["reward"] == pytest.approx(2.0 * row["reward/exact_match"] + 0.5 * row["reward/text_code"])
        assert "advantage" not in row
        assert row["extracted_answer"] == row["response"].strip()  # exact_match votes with the stripped text


def test_show_samples_prints_them_after_each_step_line(chat_run) -> None:
    _, _, _, proc = chat_run
    lines = proc.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("step ") and not line.startswith("step 0/")]
    assert len(steps) == STEPS  # (step 0: the evaluation before training)
    for i in steps:
        assert "kl_ref " in lines[i]  # GRPO's KL to the reference on the step line
        shown = lines[i + 1 : i + 1 + 3 * SHOWN]
        assert [line.split(":")[0] for line in shown[::3]] == ["  sample (group 0)", "  sample (group 1)"]
        assert all(line.startswith("    prompt   …") for line in shown[1::3])  # the prompt's end, on one line
        assert all(line.startswith("    response ") for line in shown[2::3])
    assert sum(line.startswith("  sample (group") for line in lines) == STEPS * SHOWN
    assert "  rollout sync, local engine" in proc.stdout  # the header says sync/async


def test_resume_cuts_the_samples_back(chat_run, tmp_path: Path) -> None:
    """Step 3's checkpoint is damaged: the resume redoes step 3 from step 2's; its rows (and the evaluation after
    it) are in the files once, and the same as the uninterrupted run's (seeded sampling)."""
    out, model, data, _ = chat_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    (copy / "checkpoints" / "step_000000003" / "COMPLETE").unlink()
    proc = _train(copy, model, data)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    for name in ("samples.jsonl", "eval_samples.jsonl"):
        assert _rows(copy / name) == _rows(out / name), name


# ---------------------------------------------------------------------------------------------- the parts
def _sample(
    tokenizer, text: str, group: int, *, extra: tuple[int, ...] = (), finish: str = "stop", **metadata
) -> Sample:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + list(extra)
    if finish == "stop":
        ids.append(tokenizer.eos_token_id)
    return Sample([5, 6, 7], ids, [-0.1] * len(ids), finish, "v1", group_index=group, reward=1.5, metadata=metadata)


def test_pick_samples_spreads_over_groups() -> None:
    assert pick_samples([0, 0, 0, 1, 1, 1, 2, 2, 2], 4) == [0, 3, 6, 1]
    assert pick_samples([0, 0, 1, 1], 8) == [0, 2, 1, 3]  # fewer samples than asked: all of them
    assert pick_samples([1, 1, 0], 2) == [2, 0]  # group order, not position
    assert pick_samples([], 3) == []


def test_rows_decode_the_response_as_the_reward_reads_it(tokenizer) -> None:
    reserved = tokenizer.convert_tokens_to_ids("<reserved_0>")
    pad = tokenizer.pad_token_id
    s = _sample(tokenizer, "12\n3", 4, extra=[reserved, pad], prompt="<|im_start|>user\n321<|im_end|>\n", answer="7")
    s.reward_parts = {"exact_match": 0.0, "format": 0.75}
    (row,) = sample_rows(9, [s], [-0.25], tokenizer, [0])
    assert row == {
        "step": 9, "group": 4, "prompt": "<|im_start|>user\n321<|im_end|>\n", "response": "12\n3<reserved_0>",
        "reward": 1.5, "reward/exact_match": 0.0, "reward/format": 0.75, "advantage": -0.25, "length": 7,
        "finish_reason": "stop", "answer": "7", "data_source": None,
    }  # fmt: skip
    assert row["response"] == tokenizer.decode(s.response_ids, skip_special_tokens=True)
    bare = _sample(tokenizer, "5", 0, finish="length")  # no prompt text kept: the prompt tokens decoded
    (row,) = sample_rows(1, [bare], [0.0], tokenizer, [0])
    assert row["prompt"] == tokenizer.decode([5, 6, 7]) and row["finish_reason"] == "length" and row["length"] == 1


def test_a_trajectory_row_holds_its_observations(tokenizer) -> None:
    """Multi-turn: the response is every response token decoded, the environment's (untrained) observations too."""
    turn, observation, answer = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("2+2=", "[4]", "4"))
    ids = turn + observation + answer + [tokenizer.eos_token_id]
    mask = [1] * len(turn) + [0] * len(observation) + [1, 1]
    s = Sample([5], ids, [0.0] * len(ids), "stop", "v0", reward=1.0, loss_mask=mask, metadata={"prompt": "q"})
    (row,) = sample_rows(1, [s], [1.0], tokenizer, [0])
    assert row["response"] == "2+2=[4]4" and row["length"] == len(ids)


def test_cut_back_keeps_rows_before_the_first_step(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    steps = [0, 0, 1, 1, 2, 2, 3]
    path.write_text("".join(json.dumps({"step": s, "i": i}) + "\n" for i, s in enumerate(steps)) + '{"step": 4, "i')
    assert cut_back(path, 2) == 4
    assert _rows(path) == [{"step": s, "i": i} for i, s in enumerate(steps[:4])]
    assert cut_back(tmp_path / "missing.jsonl", 1) == 0 and not (tmp_path / "missing.jsonl").exists()


def test_sample_log_writes_every_n_steps_and_shows_without_writing(tmp_path: Path, tokenizer) -> None:
    cfg = LoggingConfig(wandb=False, samples_every=2, samples_per_step=3, show_samples=1)
    log = SampleLog(cfg, tmp_path, tokenizer)
    samples = [_sample(tokenizer, str(i), i // 2, prompt=f"p{i}") for i in range(6)]
    for step in (1, 2):
        log.add_step(step, samples, [0.5] * 6)
    tables, excerpt = log.take(1)
    assert tables == {} and excerpt.count("  sample (group 0)") == 1  # shown, not written (samples_every=2)
    tables, excerpt = log.take(2)
    assert [r["prompt"] for r in tables["samples"]] == ["p0", "p2", "p4"]
    assert [r["step"] for r in _rows(tmp_path / "samples.jsonl")] == [2, 2, 2]
    assert excerpt.splitlines()[0] == "  sample (group 0): reward 1.500 | adv +0.500 | stop | 2 tokens"
    assert log.take(3) == ({}, "")
    never = SampleLog(LoggingConfig(samples_every=0), tmp_path / "never", tokenizer)
    never.add_step(1, samples, [0.0] * 6)
    assert never.take(1) == ({}, "") and not (tmp_path / "never" / "samples.jsonl").exists()


def test_console_lines_are_one_line_each() -> None:
    assert one_line("a\nb", 10) == "a\\nb"
    assert one_line("x" * 20, 8) == "xxxxxxx…" and one_line("abcdefghij", 5, keep_end=True) == "…ghij"
    row = {"group": 1, "prompt": "q" * 300 + "\nend", "response": "r\n" * 200, "reward": 0.0, "reward/a": 0.0,
           "advantage": -1.0, "length": 16, "finish_reason": "length"}  # fmt: skip
    head, prompt, response = format_samples([row], width=40).splitlines()
    assert head == "  sample (group 1): reward 0.000 (a 0) | adv -1.000 | length | 16 tokens"
    assert prompt == "    prompt   …" + ("q" * 300 + "\\nend")[-39:] and len(response) == len("    response ") + 40


def test_one_dataset_eval_name() -> None:
    from megatron_rl.config.schema import DataConfig

    assert [e.name for e in DataConfig(eval="synthetic").eval_sets()] == ["synthetic"]
    assert [e.name for e in DataConfig(eval="data/gsm8k/test.parquet").eval_sets()] == ["test"]
    assert [e.name for e in DataConfig(eval="data/gsm8k_ds/").eval_sets()] == ["gsm8k_ds"]


def test_wandb_tables_of_an_offline_run(tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggingConfig(wandb=True, wandb_mode="offline", plot=False, samples_per_step=3)
    samples = SampleLog(cfg, tmp_path, tokenizer)
    log = RunLog(cfg, tmp_path, 2, {}, wandb_id="samplestable", samples=samples)
    batch = [_sample(tokenizer, f"{i}{i}", i // 2, prompt=f"p{i}", answer=str(i), data_source="d") for i in range(4)]
    for s in batch:
        s.reward_parts = {"exact_match": 1.0}
    batch[2].metadata["answer"] = 2  # a column of text and numbers (as a user's rows may have)
    samples.add_step(1, batch, [0.5, -0.5, 1.0, -1.0])
    samples.add_eval(1, batch[:2], "held_out")
    log.log(1, {"rollout/reward_mean": 1.5})
    log.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*-samplestable")
    for name, file in (("samples", "samples.jsonl"), ("eval_samples", "eval_samples.jsonl")):
        (table,) = (run / "files" / "media" / "table").glob(f"{name}_*.table.json")
        logged = json.loads(table.read_text())
        rows = _rows(tmp_path / file)
        assert logged["columns"] == list(rows[0]) and logged["data"] == [list(r.values()) for r in rows]
    assert len(_rows(tmp_path / "samples.jsonl")) == 3 and len(_rows(tmp_path / "eval_samples.jsonl")) == 2


# ---------------------------------------------------------------------------------------------- mismatch.png
def test_k3_is_never_drawn_below_zero() -> None:
    points = [(1, 2e-9), (2, -1e-9), (3, 0.0), (4, -3e-12)]
    assert plot_series("mismatch/k3_kl", points) == [(1, 2e-9), (2, 0.0), (3, 0.0), (4, 0.0)]
    assert plot_series("mismatch/logp_abs_diff", points) == points  # only the series that are >= 0 in exact math


def test_mismatch_plot_has_no_axis_offset_and_a_healthy_band() -> None:
    history = [
        {"step": s, "mismatch/logp_abs_diff": 1.00002e-3 + 1e-9 * s, "mismatch/k3_kl": -1e-9 if s % 2 else 1e-8}
        for s in range(1, 11)
    ]
    fig = figure("mismatch.png", "mismatch", series_of(history, ("mismatch/logp_abs_diff", "mismatch/k3_kl")))
    fig.canvas.draw()
    diff_ax, k3_ax = fig.axes
    for ax in (diff_ax, k3_ax):
        formatter = ax.yaxis.get_major_formatter()
        assert formatter.get_useOffset() is False and formatter.offset == 0  # matplotlib would offset 1.00002e-3
        assert len(ax.patches) == 1  # the shaded healthy range
    assert min(k3_ax.lines[0].get_ydata()) == 0.0 and k3_ax.get_ylim()[0] == 0.0  # no negative half-axis
    assert ">= 0" in k3_ax.get_ylabel()
    assert diff_ax.get_ylim()[1] < 1.1e-3  # the band (up to 1e-2) does not rescale the axis: the data decides
    zeros = [{"step": s, "mismatch/k3_kl": 0.0} for s in range(1, 4)]  # CPU fp32: the engine is the trainer
    (k3_ax,) = figure("mismatch.png", "mismatch", series_of(zeros, ("mismatch/k3_kl",))).axes
    assert k3_ax.get_ylim() == (0.0, 1e-3)  # the healthy range's height, not matplotlib's +-0.05 around 0
