"""The PNG plots of a run's curves (written at the end of a run from its metrics history).

Readability rules every figure follows: no axis offset (matplotlib's "+1.0002e0" above the ticks makes values
unreadable), one panel per metric of a figure whose metrics' scales differ, a log axis where a positive series
spans more than two decades. The mismatch figure clamps the k3 estimate at 0 and shades the healthy range.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# (file name, title, metric keys) of the plots written at the end of a run.
PLOTS = (
    ("reward.png", "reward and held-out accuracy", ("rollout/reward_mean", "eval/accuracy")),
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
    """The matplotlib figure of one entry of PLOTS (Agg backend); reward and accuracy share one [0, 1] axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    panels = 1 if name == "reward.png" else len(series)
    fig, axes = plt.subplots(panels, 1, figsize=(7, 2.2 + 1.8 * panels), sharex=True, squeeze=False)
    for i, (key, points) in enumerate(series.items()):
        ax = axes[min(i, panels - 1)][0]
        ax.plot(*zip(*points, strict=True), marker="o" if len(points) < 30 else None, label=key)
        values = [v for _, v in points]
        if panels > 1 and spans_decades(values):
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
        ax.legend(loc="best", fontsize=8)
    axes[-1][0].set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, not 1.25
    axes[0][0].set_title(title)
    fig.tight_layout()
    return fig


def write_plots(history: list[dict[str, float]], output_dir: Path) -> list[Path]:
    """One PNG per entry of PLOTS that has data, in `output_dir`; the paths written."""
    import matplotlib.pyplot as plt

    written = []
    for name, title, keys in PLOTS:
        series = series_of(history, keys)
        if not series:
            continue
        fig = figure(name, title, series)
        path = output_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
