"""Evaluation per dataset in what a run shows: headlines in reward.png, a panel each in eval.png, the step line."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from PIL import Image

from megatron_rl.config.schema import LoggingConfig
from megatron_rl.trainer.logs.plots import eval_headlines, expand_keys, figures, matches, write_plots
from megatron_rl.trainer.logs.run_log import RunLog

GSM8K = {"mean@4": 0.25, "pass@1": 0.25, "pass@2": 0.4, "pass@4": 0.6, "maj@2": 0.3, "maj@4": 0.35}
# Two mean@ keys (the larger n is the headline) and pass@16 after pass@2 (numbers sort by value, not as text).
MATH = {"mean@2": 0.1, "mean@16": 0.12, "pass@1": 0.12, "pass@2": 0.2, "pass@16": 0.5, "maj@16": 0.15}


def _two_dataset_history() -> list[dict[str, float]]:
    """Rollout reward every step 1..6, evaluation at steps 0, 2, 4, 6: gsm8k (4 samples), math (16), aime (greedy)."""
    history: list[dict[str, float]] = []
    for step in range(7):
        row: dict[str, float] = {"step": step}
        if step > 0:
            row["rollout/reward_mean"] = step / 10
        if step % 2 == 0:
            gain = step / 100
            row |= {f"eval/gsm8k/{metric}": value + gain for metric, value in GSM8K.items()}
            row |= {f"eval/math/{metric}": value + gain for metric, value in MATH.items()}
            row |= {"eval/aime/accuracy": 0.05 + gain, "eval/gsm8k/response_length": 120.0 + step}
            row |= {"eval/gsm8k/truncation_rate": 0.1, "time/eval/gsm8k": 3.0, "eval/weight_version": float(step)}
        history.append(row)
    return history


def _lines(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_patterns_match_within_one_part_and_sort_numbers_by_value() -> None:
    assert matches("eval/*/accuracy", "eval/gsm8k/accuracy")
    assert not matches("eval/*/accuracy", "eval/accuracy")  # the one-dataset key has no dataset part
    assert not matches("eval/*", "eval/gsm8k/accuracy")  # `*` does not cross a `/`
    assert not matches("eval/*/mean@*", "time/eval/gsm8k")
    keys = ["eval/b/pass@16", "eval/b/pass@2", "eval/a/pass@4", "eval/a/maj@4", "rollout/reward_mean", "step"]
    assert expand_keys(("rollout/reward_mean", "eval/*/pass@*", "eval/*/pass@2"), keys) == (
        "rollout/reward_mean",
        "eval/a/pass@4",
        "eval/b/pass@2",
        "eval/b/pass@16",
    )  # each key once, in the first pattern that names it
    assert expand_keys(("eval/accuracy",), keys) == ("eval/accuracy",)  # a plain key is kept; series_of drops it


def test_headline_is_greedy_accuracy_else_the_largest_mean() -> None:
    keys = [
        "eval/accuracy", "eval/mean@1", "time/eval/gsm8k", "eval/gsm8k/mean@4", "eval/gsm8k/mean@16",
        "eval/gsm8k/pass@16", "eval/aime/mean@1", "eval/aime/accuracy", "eval/x/response_length",
    ]  # fmt: skip
    headlines = eval_headlines(keys)
    assert headlines == {"aime": "eval/aime/accuracy", "gsm8k": "eval/gsm8k/mean@16"}
    assert list(headlines) == ["aime", "gsm8k"]


def test_reward_plot_has_a_line_per_dataset_and_eval_plot_a_panel_per_dataset() -> None:
    built = dict(figures(_two_dataset_history()))
    try:
        assert list(built) == ["reward.png", "eval.png"]
        (reward_ax,) = built["reward.png"].axes  # reward and every headline share one axis
        lines = _lines(reward_ax)
        assert list(lines) == ["rollout/reward_mean", "aime accuracy", "gsm8k mean@4", "math mean@16"]
        assert lines["rollout/reward_mean"] == ([1, 2, 3, 4, 5, 6], pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
        assert lines["gsm8k mean@4"] == ([0, 2, 4, 6], pytest.approx([0.25, 0.27, 0.29, 0.31]))
        assert lines["math mean@16"][1] == pytest.approx([0.12, 0.14, 0.16, 0.18])
        assert lines["aime accuracy"][1] == pytest.approx([0.05, 0.07, 0.09, 0.11])

        aime_ax, gsm8k_ax, math_ax = built["eval.png"].axes
        assert aime_ax.get_title() == "evaluation per dataset"
        assert list(_lines(aime_ax)) == ["aime accuracy"]
        gsm8k = _lines(gsm8k_ax)
        assert list(gsm8k) == [f"gsm8k {m}" for m in ("mean@4", "pass@1", "pass@2", "pass@4", "maj@2", "maj@4")]
        assert gsm8k["gsm8k pass@4"] == ([0, 2, 4, 6], pytest.approx([0.6, 0.62, 0.64, 0.66]))
        styles = {line.get_label(): line.get_linestyle() for line in gsm8k_ax.lines}
        assert (styles["gsm8k mean@4"], styles["gsm8k pass@2"], styles["gsm8k maj@4"]) == ("-", "--", ":")
        math_lines = _lines(math_ax)
        assert list(math_lines) == [f"math {m}" for m in ("mean@2", "mean@16", "pass@1", "pass@2", "pass@16", "maj@16")]
        assert math_lines["math maj@16"][1] == pytest.approx([0.15, 0.17, 0.19, 0.21])
        assert all(ax.get_yscale() == "linear" for ax in built["eval.png"].axes)  # fractions: one linear scale
    finally:
        for fig in built.values():
            plt.close(fig)


def test_eval_plot_needs_sampled_evaluation_and_is_written_with_a_panel_per_dataset(tmp_path: Path) -> None:
    greedy = [{"step": s, "rollout/reward_mean": 0.5, "eval/aime/accuracy": 0.1 * s} for s in range(3)]
    assert [p.name for p in write_plots(greedy, tmp_path)] == ["reward.png"]  # no pass@k: no eval.png
    written = {p.name: p for p in write_plots(_two_dataset_history(), tmp_path)}
    assert set(written) == {"reward.png", "eval.png"}
    assert Image.open(written["eval.png"]).size == (700, 760)  # 100 dpi, 2.2 in + 1.8 in x 3 datasets


def test_one_dataset_history_draws_as_before() -> None:
    history = [
        {"step": s, "rollout/reward_mean": s / 4, "eval/accuracy": 0.5 + s / 10, "eval/mean@1": 0.5 + s / 10}
        for s in range(1, 4)
    ]
    built = dict(figures(history))
    try:
        assert list(built) == ["reward.png"]
        (ax,) = built["reward.png"].axes
        assert _lines(ax) == {
            "rollout/reward_mean": ([1, 2, 3], [0.25, 0.5, 0.75]),
            "eval/accuracy": ([1, 2, 3], pytest.approx([0.6, 0.7, 0.8])),
        }
    finally:
        for fig in built.values():
            plt.close(fig)


def test_step_line_shows_each_datasets_headline_after_eval_acc(tmp_path: Path) -> None:
    log = RunLog(LoggingConfig(wandb=False, tensorboard=False), tmp_path, 5, {})
    row = {
        "rollout/reward_mean": 0.5, "eval/gsm8k/mean@4": 0.4123, "eval/gsm8k/pass@4": 0.7, "eval/aime/accuracy": 0.2,
        "eval/math/accuracy": math.nan, "time/eval/gsm8k": 3.0, "actor/pg_loss": 0.01, "time/step": 1.0,
    }  # fmt: skip
    assert log.format_line(1, row) == (
        "step 1/5 | reward 0.500 | aime accuracy 0.200 | gsm8k mean@4 0.412 | loss 0.0100 | s/step 1.0 | eta 0m04s"
    )  # the NaN math headline is left out, as every non-finite metric
    old = {"rollout/reward_mean": 0.5, "eval/accuracy": 0.83, "eval/mean@1": 0.83, "time/step": 1.0}
    assert log.format_line(1, old) == "step 1/5 | reward 0.500 | eval_acc 0.830 | s/step 1.0 | eta 0m04s"
    assert "mean@" not in log.format_line(1, {"rollout/reward_mean": 0.5})  # a step without evaluation
    log.close()
