"""How much the learning tests' metrics move across seeds and CPU kernels, and what a broken gradient gives.

A seeded CPU run is reproducible on one machine but not across CPUs: BLAS/oneDNN pick other kernels (AVX-512,
AVX2, no SIMD) and other reduction orders (1 or 2 threads), the fp32 rounding differs and a 60-step RL trajectory
drifts. This script runs each learning test's scenario (the command its test runs) over a grid of

  seed      the tiny model's seed and `trainer.seed` together (the test's is 1234)
  kernels   env ATEN_CPU_CAPABILITY = native (what this CPU has), avx2, default (no SIMD)
  threads   `trainer.cpu_threads` = 1 or 2 (torch's intra-op threads: another reduction order)
  loss      the test's loss, or a broken gradient registered in the worker process only: `gspo_sign_flipped`
            (minus the GSPO loss: gradient ascent on the surrogate) and `gspo_zeroed` (0 x the GSPO loss: no
            gradient, the weights stay at the warm-up's); `ppo_*` likewise for the GRPO example

and writes every run's metrics to benchmarks/results/learning_margins_<date>.json. The test bounds are set below
the worst healthy run and above the best broken one (docs/testing.md lists them).

  python benchmarks/learning_margins.py --scenario tool --grid full
  python benchmarks/learning_margins.py --scenario loop --seeds 1234 1 2 --kernels native --threads 1
  python benchmarks/learning_margins.py --summary benchmarks/results/learning_margins_20261201.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere
RESULTS = REPO / "benchmarks" / "results"
COMMON = ("trainer.save_every=0", "logging.wandb=false", "logging.plot=false")
BROKEN = ("sign_flipped", "zeroed")  # <loss>_sign_flipped, <loss>_zeroed


def register_broken_losses() -> None:
    """Register `<loss>_sign_flipped` (minus the loss) and `<loss>_zeroed` (0 x the loss) for the GSPO and PPO
    losses, in this process only (the benchmark's worker)."""
    from megatron_rl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossFn

    def broken(base: PolicyLossFn, scale: float) -> PolicyLossFn:
        def loss(*args: Any) -> Any:
            terms = base(*args)
            return terms._replace(loss=terms.loss * scale)

        return loss

    for name in ("gspo", "ppo"):
        POLICY_LOSSES.register(f"{name}_sign_flipped")(broken(POLICY_LOSSES.get(name), -1.0))
        POLICY_LOSSES.register(f"{name}_zeroed")(broken(POLICY_LOSSES.get(name), 0.0))


@dataclass(frozen=True)
class Scenario:
    """One learning test: its config and overrides, and how its metrics are read from metrics.jsonl."""

    test: str
    config: str
    overrides: tuple[str, ...]
    metrics: Callable[[list[dict]], dict[str, float]]
    threads: int  # the test's torch threads (trainer.cpu_threads; the tool config's default 0 is 2 on 2 cores)
    loss: str = "gspo"  # the config's policy loss, which the broken variants break


def _mean(rows: list[dict], key: str) -> float:
    """The mean of `key` over `rows`; a row without it counts 0 (a broken run that makes no tool call logs no
    tool-call success rate)."""
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


def _eval(history: list[dict]) -> dict[str, float]:
    evals = [r for r in history if "eval/accuracy" in r]
    return {"eval_before": evals[0]["eval/accuracy"], "eval_after": evals[-1]["eval/accuracy"]}


def tool_metrics(history: list[dict]) -> dict[str, float]:
    steps = [r for r in history if r["step"] > 0]
    early, late = steps[:20], steps[-20:]
    out = _eval(history)
    for name, key in (
        ("reward", "rollout/reward_mean"),
        ("tool_success", "multi_turn/tool_success_rate"),
        ("tool_errors", "multi_turn/tool_errors_per_trajectory"),
    ):
        out[f"{name}_early"], out[f"{name}_late"] = _mean(early, key), _mean(late, key)
    for key in ("multi_turn/turns_mean", "multi_turn/observation_token_share"):  # the test's per-step ranges
        name = key.split("/")[1]
        values = [r[key] for r in steps if key in r]
        out[f"{name}_min"], out[f"{name}_max"] = min(values, default=0.0), max(values, default=0.0)
    return out


def loop_metrics(history: list[dict]) -> dict[str, float]:
    steps = [r for r in history if r["step"] > 0]
    out = _eval(history)
    out["reward_early"], out["reward_late"] = _mean(steps[:10], "rollout/reward_mean"), _mean(
        steps[-10:], "rollout/reward_mean"
    )
    out["logp_abs_diff_max"] = max(r.get("mismatch/logp_abs_diff", 0.0) for r in steps)  # the test's bound
    return out


SCENARIOS: dict[str, Scenario] = {
    # tests/trainer/test_tool_task_learns.py
    "tool": Scenario(
        "tests/trainer/test_tool_task_learns.py",
        "examples/tiny_moe_tool_gspo.yaml",
        ("trainer.steps=60", "data.eval_every=60", "data.eval_prompts=256"),
        tool_metrics,
        2,
    ),
    # tests/trainer/test_train_loop.py::test_loop_learns_with_exact_first_update (its FAST overrides)
    "loop": Scenario(
        "tests/trainer/test_train_loop.py::test_loop_learns_with_exact_first_update",
        "examples/tiny_moe_gspo.yaml",
        ("warmup.sft_steps=150", "warmup.sft_batch_size=32", "warmup.sft_lr=2e-3", "optimizer.lr=1e-4",
         "trainer.steps=30", "data.eval_every=30", "data.eval_prompts=256"),
        loop_metrics,
        1,
    ),  # fmt: skip
    # the demo as the README runs it (examples/tiny_moe_gspo.yaml: 100 steps), held-out set of 256
    "demo": Scenario(
        "README.md demo (examples/tiny_moe_gspo.yaml)",
        "examples/tiny_moe_gspo.yaml",
        ("data.eval_every=100", "data.eval_prompts=256"),
        loop_metrics,
        1,
    ),
    # tests/trainer/test_sft_user_data.py::test_the_gsm8k_example_sft_then_grpo_raises_held_out_accuracy (slow)
    "gsm8k": Scenario(
        "tests/trainer/test_sft_user_data.py::test_the_gsm8k_example_sft_then_grpo_raises_held_out_accuracy",
        "examples/tiny_gsm8k_sft_grpo.yaml",
        (),
        loop_metrics,
        1,
        "ppo",
    ),
}


@dataclass(frozen=True)
class Variant:
    seed: int
    kernels: str  # native | avx2 | default
    threads: int
    loss: str  # "" = the config's


def run_variant(name: str, scenario: Scenario, v: Variant, work: Path) -> dict:
    """One `megatron-rl train` run of the scenario under variant `v`; its metrics and timings."""
    from megatron_rl.tiny_model import make_tiny_qwen3_moe

    folder = Path(tempfile.mkdtemp(dir=work))
    model = make_tiny_qwen3_moe(folder / "model", seed=v.seed)
    out = folder / "run"
    args = ["train", str(REPO / scenario.config), f"trainer.output_dir={out}", f"model.hf_path={model}",
            *scenario.overrides, *COMMON, f"trainer.seed={v.seed}", f"trainer.cpu_threads={v.threads}"]  # fmt: skip
    if v.loss:
        args.append(f"algo.loss={v.loss}")
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if v.kernels != "native":
        env["ATEN_CPU_CAPABILITY"] = v.kernels
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=3600,
    )  # fmt: skip
    wall = time.perf_counter() - start
    record: dict = {"scenario": name, **asdict(v), "wall_s": round(wall, 1), "returncode": proc.returncode}
    if proc.returncode != 0:
        record["error"] = (proc.stdout[-1500:] + proc.stderr[-3000:]).strip()
        return record
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    record["metrics"] = {k: x if abs(x) < 1e-3 else round(x, 4) for k, x in scenario.metrics(history).items()}
    record["reward_curve"] = [round(r["rollout/reward_mean"], 3) for r in history if r["step"] > 0]
    printed = dict(line.split("=", 1) for line in proc.stdout.splitlines() if line.startswith(("cpu_", "eval_s=")))
    record["capability"] = printed.get("cpu_capability", "")
    record["eval_s"] = [float(line[7:]) for line in proc.stdout.splitlines() if line.startswith("eval_s=")]
    return record


def worker(argv: list[str]) -> int:
    """`megatron-rl train argv...` in this process, with the broken losses registered."""
    import torch

    register_broken_losses()
    print(f"cpu_capability={torch.backends.cpu.get_cpu_capability()}", flush=True)
    from megatron_rl.cli import main
    from megatron_rl.trainer import loop

    evaluate = loop.evaluate

    def timed_evaluate(*a: Any, **k: Any) -> dict[str, float]:
        start = time.perf_counter()
        try:
            return evaluate(*a, **k)
        finally:
            print(f"eval_s={time.perf_counter() - start:.2f}", flush=True)

    loop.evaluate = timed_evaluate  # the benchmark's worker only: how long the held-out evaluation takes

    return main(argv)


def grid(args: argparse.Namespace, scenario: Scenario) -> list[Variant]:
    """The variants to run: the full grid, or the product of the given seeds, kernels, threads and losses."""
    threads = scenario.threads
    if args.grid == "full":
        # every seed on this CPU's kernels; the test's seed and one other on every kernel x thread count; the broken
        # losses on every seed
        out = [Variant(s, "native", threads, "") for s in args.seeds]
        for s in args.seeds[:2]:
            for k in ("native", "avx2", "default"):
                for t in (1, 2):
                    if (k, t) != ("native", threads):
                        out.append(Variant(s, k, t, ""))
        out += [Variant(s, "native", threads, f"{scenario.loss}_{b}") for b in BROKEN for s in args.seeds]
        return out
    return [
        Variant(s, k, t, loss)
        for loss in args.losses
        for s in args.seeds
        for k in args.kernels
        for t in (args.threads or [threads])
    ]


def summarise(runs: list[dict]) -> dict:
    """Per scenario and metric-difference: min/max over healthy runs, max over broken ones."""
    summary: dict = {}
    for name in sorted({r["scenario"] for r in runs}):
        ok = [r for r in runs if r["scenario"] == name and "metrics" in r]
        rises: dict[str, dict[str, list[float]]] = {}
        for r in ok:
            m = r["metrics"]
            kind = r["loss"] or "healthy"
            for key in m:
                if key.endswith(("_before", "_early")):
                    base = key.rsplit("_", 1)[0]
                    after = m.get(f"{base}_after", m.get(f"{base}_late"))
                    rises.setdefault(f"{base}_rise", {}).setdefault(kind, []).append(round(after - m[key], 4))
                    rises.setdefault(key, {}).setdefault(kind, []).append(m[key])
        summary[name] = {
            metric: {kind: {"min": min(v), "max": max(v), "mean": round(statistics.mean(v), 4), "n": len(v)}
                     for kind, v in kinds.items()}
            for metric, kinds in rises.items()
        }  # fmt: skip
        summary[name]["wall_s_median"] = statistics.median(r["wall_s"] for r in ok) if ok else None
    return summary


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _torch_version() -> str:
    import torch

    return f"{torch.__version__}, native kernels {torch.backends.cpu.get_cpu_capability()}"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), nargs="+", default=["tool"])
    parser.add_argument("--grid", choices=["full", "custom"], default="custom", help="full: the grid in the doc")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--kernels", nargs="+", default=["native"], help="native, avx2, default")
    parser.add_argument("--threads", type=int, nargs="+", help="default: the test's")
    parser.add_argument("--losses", nargs="+", default=[""], help="'' = the config's, or gspo|ppo_sign_flipped|zeroed")
    parser.add_argument("--out", type=Path, help="JSON results file; runs are appended to it as they finish")
    parser.add_argument("--summary", type=Path, help="print the summary of a results file and exit")
    args = parser.parse_args()
    if args.summary:
        print(json.dumps(summarise(json.loads(args.summary.read_text())["runs"]), indent=1))
        return 0
    out = args.out or RESULTS / f"learning_margins_{datetime.date.today():%Y%m%d}.json"
    command = "python benchmarks/learning_margins.py " + " ".join(sys.argv[1:])
    doc: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": _torch_version(), "date": f"{datetime.date.today():%Y-%m-%d}"},
        "command": [],
        "runs": [],
    }  # fmt: skip
    if isinstance(doc["command"], str):
        doc["command"] = [doc["command"]]
    doc["command"].append(command)  # every command that added runs to this file
    with tempfile.TemporaryDirectory() as work:
        for name in args.scenario:
            for v in grid(args, SCENARIOS[name]):
                if any(r["scenario"] == name and Variant(r["seed"], r["kernels"], r["threads"], r["loss"]) == v
                       and "metrics" in r for r in doc["runs"]):  # fmt: skip
                    continue  # measured already (a rerun into the same file resumes)
                record = run_variant(name, SCENARIOS[name], v, Path(work))
                print(json.dumps(record), flush=True)
                doc["runs"].append(record)
                doc["summary"] = summarise(doc["runs"])
                out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
