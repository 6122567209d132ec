"""The PNG plots of a run's curves (written at the end of a run from its metrics history).

Readability rules every figure follows: no axis offset (matplotlib's "+1.0002e0" above the ticks makes values
unreadable), one panel per metric of a figure whose metrics' scales differ, a log axis where a positive series
spans more than two decades. The mismatch figure clamps the k3 estimate at 0 and shades the healthy range.
Evaluation metrics per dataset (`eval/<name>/<metric>`) are named by patterns, so every dataset of `data.eval` gets
its line: its headline in reward.png, a panel of its mean@n, pass@k and maj@k curves in eval.png.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

# Stands for each evaluation dataset's headline metric (`eval_headlines`) in a PLOTS entry.
EVAL_HEADLINES = "eval/*/<headline>"
# (file name, title, metric keys) of the plots written at the end of a run. A key may be a pattern whose `*` and `?`
# match within one `/`-separated part (`eval/*/pass@*`), expanded against the history's keys (`expand_keys`).
PLOTS = (
    ("reward.png", "reward and held-out accuracy", ("rollout/reward_mean", "eval/accuracy", EVAL_HEADLINES)),
    ("eval.png", "evaluation per dataset", ("eval/*/accuracy", "eval/*/mean@*", "eval/*/pass@*", "eval/*/maj@*")),
    ("train.png", "policy", ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm")),
    ("mismatch.png", "trainer vs rollout log-probs", ("mismatch/logp_abs_diff", "mismatch/k3_kl")),
    (
        "tools.png",
        "multi-turn tool use (rollouts)",
        (
            "multi_turn/tool_success_rate",
            "multi_turn/tool_calls_per_trajectory",
            "multi_turn/turns_mean",
            "multi_turn/observation_token_share",
        ),
    ),
    ("async.png", "asynchronous RL", ("async/staleness_mean", "async/trainer_wait_s", "async/engine_wait_s")),
)

# Healthy trainer-vs-engine mismatch, shaded in mismatch.png: mean |logp diff| below ~1e-2 and k3 KL below ~1e-3
# are the typical values of healthy bf16 runs in verl's and slime's rollout-correction reports (a mismatch bug
# shows 1e-1 and more); on CPU in fp32 both are ~0.
HEALTHY_BELOW = {"mismatch/logp_abs_diff": 1e-2, "mismatch/k3_kl": 1e-3}
# Series that are >= 0 mathematically; their small negatives are float rounding and are drawn as 0.
NON_NEGATIVE = {"mismatch/k3_kl": "k3 KL (>= 0; rounding negatives drawn as 0)"}
# A plot written only when the history has a key of this pattern: eval.png needs sampled evaluation (pass@k).
WRITTEN_IF = {"eval.png": "eval/*/pass@*"}
# Line style of an evaluation metric by its kind, so a panel's mean@n (solid), pass@k and maj@k read apart.
EVAL_LINESTYLE = {"pass": "--", "maj": ":"}


def matches(pattern: str, key: str) -> bool:
    """Whether `key` matches `pattern` part by part (`/`-separated; fnmatch within a part, case-sensitive), so
    `eval/*/accuracy` takes `eval/gsm8k/accuracy` but neither `eval/accuracy` nor `time/eval/gsm8k`."""
    parts, key_parts = pattern.split("/"), key.split("/")
    return len(parts) == len(key_parts) and all(fnmatchcase(k, p) for p, k in zip(parts, key_parts, strict=True))


def _natural(key: str) -> list[Any]:
    """Sort key that orders the numbers in a name by value: pass@2 before pass@16."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def eval_headlines(keys: Iterable[str]) -> dict[str, str]:
    """The headline metric key of each evaluation dataset among `keys`, by dataset name (sorted):
    `eval/<name>/accuracy` when the dataset is greedy, else its `eval/<name>/mean@<n>` of the largest n (pass@1
    averaged over n samples)."""
    best: dict[str, tuple[tuple[bool, int], str]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != "eval":
            continue
        mean = re.fullmatch(r"mean@(\d+)", parts[2])
        if parts[2] != "accuracy" and mean is None:
            continue
        rank = (parts[2] == "accuracy", int(mean.group(1)) if mean else 0)
        if parts[1] not in best or rank > best[parts[1]][0]:
            best[parts[1]] = (rank, key)
    return {name: best[name][1] for name in sorted(best)}


def expand_keys(patterns: Iterable[str], keys: Iterable[str]) -> tuple[str, ...]:
    """The metric keys `patterns` name among `keys`, in the patterns' order, each pattern's matches sorted by name
    (numbers by value), each key once; a plain key is kept as it is (`series_of` drops one without data)."""
    available = set(keys)
    expanded: dict[str, None] = {}
    for pattern in patterns:
        if pattern == EVAL_HEADLINES:
            found = list(eval_headlines(available).values())
        elif any(c in pattern for c in "*?["):
            found = sorted((k for k in available if matches(pattern, k)), key=_natural)
        else:
            found = [pattern]
        expanded.update(dict.fromkeys(found))
    return tuple(expanded)


def series_label(key: str) -> str:
    """A line's legend label: `eval/gsm8k/mean@4` reads "gsm8k mean@4"; other keys are shown as they are."""
    parts = key.split("/")
    return f"{parts[1]} {parts[2]}" if len(parts) == 3 and parts[0] == "eval" else key


def panel_of(name: str, key: str) -> str:
    """The panel of figure `name` that draws `key`: reward.png has one, eval.png one per dataset, others one per
    metric."""
    if name == "reward.png":
        return ""
    if name == "eval.png":
        return key.split("/")[1]
    return key


def plot_series(key: str, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points drawn for metric `key`: a series in NON_NEGATIVE is clamped at 0 (k3 = exp(d) - 1 - d >= 0;
    its mean comes out at -1e-9 in float rounding when the two log-probs agree)."""
    if key in NON_NEGATIVE:
        return [(step, max(value, 0.0)) for step, value in points]
    return points


def spans_decades(values: list[float], decades: float = 2.0) -> bool:
    """Whether a series is all positive and its max/min ratio exceeds 10**decades (then a log axis reads better)."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > 10**decades


def series_of(history: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    """The finite points of each key of `keys` that has any, as drawn (`plot_series`)."""
    series = {k: [(r["step"], r[k]) for r in history if k in r and math.isfinite(r[k])] for k in keys}
    return {k: plot_series(k, v) for k, v in series.items() if v}


def figure(name: str, title: str, series: dict[str, list[tuple[float, float]]]) -> Any:
    """The matplotlib figure of one entry of PLOTS (Agg backend): reward and accuracy share one [0, 1] axis, eval.png
    has a panel per dataset (`panel_of`), other figures a panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    panel_keys: dict[str, list[str]] = {}
    for key in series:
        panel_keys.setdefault(panel_of(name, key), []).append(key)
    panel_index = {panel: i for i, panel in enumerate(panel_keys)}
    panels = len(panel_keys)
    fig, axes = plt.subplots(panels, 1, figsize=(7, 2.2 + 1.8 * panels), sharex=True, squeeze=False)
    for key, points in series.items():
        panel = panel_of(name, key)
        ax = axes[panel_index[panel]][0]
        style = EVAL_LINESTYLE.get(key.rsplit("/", 1)[-1].split("@")[0], "-") if name == "eval.png" else "-"
        marker = "o" if len(points) < 30 else None
        ax.plot(*zip(*points, strict=True), linestyle=style, marker=marker, label=series_label(key))
        values = [v for _, v in points]
        if panels > 1 and len(panel_keys[panel]) == 1 and spans_decades(values):
            ax.set_yscale("log")
        else:
            formatter = ScalarFormatter(useOffset=False)
            formatter.set_powerlimits((-3, 4))  # 1e-7 as "1e-7" above the axis, never "+1.0002"
            ax.yaxis.set_major_formatter(formatter)
        if key in NON_NEGATIVE:  # from 0; an all-zero series gets the healthy range's height, not matplotlib's +-0.05
            ax.set_ylim(0.0, ax.get_ylim()[1] if max(values) > 0 else HEALTHY_BELOW.get(key, 1.0))
            ax.lines[-1].set_clip_on(False)  # the markers at 0 are drawn whole
        if key in HEALTHY_BELOW:
            bottom, top = ax.get_ylim()
            low = bottom if ax.get_yscale() == "log" else 0.0
            limit = HEALTHY_BELOW[key]
            ax.axhspan(low, limit, color="tab:green", alpha=0.12, label=f"healthy range (< {limit:g}, typical bf16)")
            ax.set_ylim(bottom, top)  # the band does not rescale the axis: the data decides
        if key in NON_NEGATIVE:
            ax.set_ylabel(NON_NEGATIVE[key], fontsize=8)
        ax.grid(alpha=0.3)
        if name == "eval.png":  # a panel holds up to ~10 curves: the legend goes beside it, not over them
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        else:
            ax.legend(loc="best", fontsize=8)
    axes[-1][0].set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, not 1.25
    axes[0][0].set_title(title)
    fig.tight_layout()
    return fig


def figures(history: list[dict[str, float]]) -> Iterator[tuple[str, Any]]:
    """(file name, figure) of each entry of PLOTS that has data (and its WRITTEN_IF key); the caller closes them."""
    available = {key for row in history for key in row}
    for name, title, patterns in PLOTS:
        if name in WRITTEN_IF and not expand_keys((WRITTEN_IF[name],), available):
            continue
        series = series_of(history, expand_keys(patterns, available))
        if series:
            yield name, figure(name, title, series)


def write_plots(history: list[dict[str, float]], output_dir: Path) -> list[Path]:
    """One PNG per figure of `figures`, in `output_dir`; the paths written."""
    import matplotlib.pyplot as plt

    written = []
    for name, fig in figures(history):
        path = output_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
