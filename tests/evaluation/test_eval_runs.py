"""Evaluation on the demo (issue P18): a run with two evaluation datasets (greedy, and 4 samples per prompt) logs
per-dataset metrics equal to a direct scoring of its logged samples, and `megatron-rl eval` of its checkpoint (and
of the HF model it started from) reproduces the run's numbers exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.rollout.tasks.synthetic_task import synthetic_reward
from tests.shared_runs import EXAMPLE

CLI = [sys.executable, "-m", "megatron_rl.cli"]
STEPS = 2
EVAL = (
    "data.eval=[{name: greedy, path: synthetic, prompts: 24},"
    " {name: sampled, path: synthetic, n_samples: 4, temperature: 1.0, prompts: 24}]"
)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def eval_run(warmed_demo, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The demo from the warmed-up model: 2 RL steps, evaluated at steps 0 and 2 on two datasets, then
    `megatron-rl eval` of its step-2 checkpoint and of the warmed-up HF model."""
    out = tmp_path_factory.mktemp("eval_run") / "run"
    _run(["train", str(EXAMPLE), f"model.hf_path={warmed_demo.warmed}", "warmup.sft_steps=0", f"trainer.steps={STEPS}",
          f"trainer.output_dir={out}", EVAL, f"data.eval_every={STEPS}", "logging.wandb=false"])  # fmt: skip
    checkpoint = _run(["eval", str(out / "config.yaml"), "--checkpoint", str(out)])
    initial = _run(["eval", str(out / "config.yaml"), "--checkpoint", str(warmed_demo.warmed),
                    "--output", str(out / "eval_initial")])  # fmt: skip
    return SimpleNamespace(out=out, checkpoint=checkpoint, initial=initial)


def _pass_at_k_brute(correct: list[bool], k: int) -> float:
    """The share of the k-subsets of one problem's samples holding a correct one (what eq. 1 estimates)."""
    subsets = list(combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def _majority(answers: list[str], correct: list[bool]) -> float:
    """Vote among the answers; a tie scores the share of the tied answers that are right."""
    votes = Counter(answers)
    top = max(votes.values())
    tied = [a for a, c in votes.items() if c == top]
    return sum(next(ok for ans, ok in zip(answers, correct, strict=True) if ans == a) for a in tied) / len(tied)


def _direct(rows: list[dict], n: int) -> dict[str, float]:
    """The dataset's metrics from its logged rows: each response scored again by the task's reward."""
    groups: dict[int, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    assert all(len(g) == n for g in groups.values())

    def right(r: dict) -> bool:
        sample = SimpleNamespace(finish_reason=r["finish_reason"])
        return synthetic_reward(sample, r["response"], {"answer": r["answer"]}) > 0.5  # type: ignore[arg-type]

    correct = [[right(r) for r in g] for g in groups.values()]
    answers = [[r["response"].strip() for r in g] for g in groups.values()]
    out = {f"mean@{n}": sum(map(sum, correct)) / (n * len(correct))}
    for k in [k for k in (1, 2, 4) if k <= n]:
        out[f"pass@{k}"] = sum(_pass_at_k_brute(c, k) for c in correct) / len(correct)
        if k > 1:  # maj@1 is not reported (the first sample's accuracy)
            out[f"maj@{k}"] = sum(_majority(a[:k], c[:k]) for a, c in zip(answers, correct, strict=True)) / len(correct)
    out["response_length"] = sum(r["length"] for r in rows) / len(rows)
    out["truncation_rate"] = sum(r["finish_reason"] == "length" for r in rows) / len(rows)
    if n == 1:
        out["accuracy"] = out["mean@1"]
    return out


def test_per_dataset_metrics_equal_a_direct_scoring_of_the_samples(eval_run) -> None:
    history = {r["step"]: r for r in _jsonl(eval_run.out / "metrics.jsonl")}
    rows = _jsonl(eval_run.out / "eval_samples.jsonl")
    assert {(r["step"], r["dataset"]) for r in rows} == {(s, d) for s in (0, STEPS) for d in ("greedy", "sampled")}
    for step in (0, STEPS):
        logged = history[step]
        assert logged["eval/weight_version"] == step
        for name, n in (("greedy", 1), ("sampled", 4)):
            own = [r for r in rows if r["step"] == step and r["dataset"] == name]
            assert len(own) == 24 * n
            direct = _direct(own, n)
            for metric, value in direct.items():
                assert logged[f"eval/{name}/{metric}"] == pytest.approx(value, abs=1e-12), (step, name, metric)
            assert logged[f"time/eval/{name}"] > 0
    assert 0.2 < history[0]["eval/greedy/accuracy"] < 0.95  # the warmed-up model: neither all wrong nor all right
    sampled = history[0]
    assert sampled["eval/sampled/pass@4"] > sampled["eval/sampled/pass@1"]  # 4 tries find more than one
    assert (eval_run.out / "eval.png").is_file() and (eval_run.out / "reward.png").is_file()


def _eval_metrics(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if k.startswith("eval/")}


def test_eval_command_reproduces_the_runs_numbers(eval_run) -> None:
    history = {r["step"]: r for r in _jsonl(eval_run.out / "metrics.jsonl")}
    folder = eval_run.out / "eval" / "step_000000002"
    record = json.loads((folder / "eval_results.json").read_text())
    assert record["step"] == STEPS and record["kind"] == "megatron"
    assert _eval_metrics(record["metrics"]) == _eval_metrics(history[STEPS])  # exactly: same weights, same seeds
    assert f"eval/sampled/pass@4: {history[STEPS]['eval/sampled/pass@4']:.6g}" in eval_run.checkpoint.stdout
    # The HF model the run started from scores the run's step 0.
    initial = json.loads((eval_run.out / "eval_initial" / "eval_results.json").read_text())
    assert initial["kind"] == "hf" and _eval_metrics(initial["metrics"]) == _eval_metrics(history[0])
    table = (folder / "eval_results.md").read_text().splitlines()
    assert table[0].startswith("| dataset | accuracy | mean@1 | mean@4 | pass@1 | pass@2 | pass@4 | maj@2 | maj@4 |")
    assert [line.split(" | ")[0] for line in table[2:]] == ["| greedy", "| sampled"]
    logged_rows = [r for r in _jsonl(eval_run.out / "eval_samples.jsonl") if r["step"] == STEPS]
    assert _jsonl(folder / "eval_samples.jsonl") == logged_rows


@pytest.mark.torchrun
@pytest.mark.parametrize("layout", ["parallel.tp=2", pytest.param("parallel.ep=2", marks=pytest.mark.slow)])
def test_eval_in_a_parallel_layout(eval_run, layout: str) -> None:
    """The step-2 checkpoint loaded into 2 ranks scores exactly as in one process: the engine gets the same full
    tensors whatever the actor's layout."""
    from tests.dist_harness import run_torchrun

    one = json.loads((eval_run.out / "eval" / "step_000000002" / "eval_results.json").read_text())["metrics"]
    out = eval_run.out / f"eval_{layout}"
    run_torchrun(Path(__file__).parents[2] / "megatron_rl" / "cli.py", 2,
                 ["eval", str(eval_run.out / "config.yaml"), layout, "--checkpoint", str(eval_run.out),
                  "--output", str(out)], timeout=600)  # fmt: skip
    two = json.loads((out / "eval_results.json").read_text())["metrics"]
    assert _eval_metrics(two) == _eval_metrics(one), layout


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(EXAMPLE, [f"model.hf_path={tmp_path}", "data.eval_every=5", *overrides])


@pytest.mark.parametrize(
    ("eval_list", "message"),
    [
        ("[{name: a, path: synthetic, n_samples: 4, pass_k: [8], temperature: 1.0}]",
         r"pass_k has k=8 but n_samples=4"),
        ("[{name: a, path: synthetic, n_samples: 4}]", r"n_samples=4 at temperature 0 gives 4 copies"),
        ("[{name: a, path: synthetic}, {name: a, path: synthetic}]", r"name='a' is used twice"),
        ("[{name: a/b, path: synthetic}]", r"data.eval\[0\].name='a/b'"),
        ("[{name: a, path: nowhere.jsonl}]", r"data.eval\[0\].path='nowhere.jsonl': no such file"),
        ("[]", r"data.eval is an empty list"),
    ],
)  # fmt: skip
def test_bad_eval_configs_are_refused_at_load(tmp_path: Path, eval_list: str, message: str) -> None:
    from megatron_rl.config import ConfigError, check_input_paths

    with pytest.raises(ConfigError, match=message):
        check_input_paths(_cfg(tmp_path, f"data.eval={eval_list}", "model.build_tiny_if_missing=true"))


def test_an_unknown_eval_reward_is_refused_before_the_model_is_built(tiny_moe_dir: Path) -> None:
    from transformers import AutoTokenizer

    from megatron_rl.evaluation.runner import Evaluator
    from megatron_rl.trainer.rollout_phase import prompt_data

    cfg = _cfg(tiny_moe_dir, "data.eval=[{name: a, path: synthetic, reward: gsmk8}]")
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_dir)
    with pytest.raises(ValueError, match="gsmk8"):
        Evaluator(prompt_data(cfg, tokenizer), tokenizer)
