"""Our RL step against Hugging Face TRL's `GRPOTrainer` on the embedded demo's settings, per phase.

Both frameworks start from the same warmed-up model (our supervised warm-up, run once here; its HF export
``<output_dir>/warmup_model``) with no further warm-up, on the same prompts (the synthetic task's training stream
for the same seed, in the same order), the same reward function (``data.reward`` of examples/tiny_moe_gspo.yaml)
and the same settings: 8 prompts x 8 samples, 16 new tokens, GSPO with clip 3e-4/4e-4, two optimizer updates per
step, fp32, AdamW at lr 1e-4, ``--threads`` CPU threads. Runs are interleaved (ours, TRL, ours, TRL, ...
``--repeats`` times) so that the shared machine's drift hits both alike.

Phases (seconds per RL step; step 1 of each run is left out, as one-time warm-up of kernels and caches):
  rollout   generation and rewards (ours: ``time/rollout``; TRL: ``_generate_and_score_completions`` less the
            old-log-prob pass inside it)
  old_logp  the old-policy log-prob pass (ours: ``time/old_logp``; TRL: its ``_get_per_token_logps_and_entropies``
            call during generation)
  train     the two updates (ours: ``time/train``; TRL: the rest of the step up to its second ``on_step_end``)
  step      the whole RL step (ours: ``time/step``, which also holds the weight sync to the engine; TRL generates
            with the training model and has none)
Ratios are ours / TRL's of the medians (goal <= 1.0). Generated tokens/s = generated tokens / step seconds.
Learning: greedy accuracy on the 64 held-out prompts before and after each run (ours: ``eval/accuracy``; TRL:
``model.generate`` greedy, the same reward) and the mean reward per step.

Our side runs ``python -m megatron_rl.cli train``; TRL's runs benchmarks/workers/trl_grpo_worker.py under
``--trl-python`` (TRL is the optional ``bench`` extra: ``pip install -e .[bench]``). Without TRL it says so and
exits 0.

    python benchmarks/bench_vs_trl.py [--steps 10] [--repeats 2] [--trl-python /tmp/peers/bin/python]
    python benchmarks/bench_vs_trl.py --steps 30 --repeats 2     # the issue's measurement
Results: a table on stdout and JSON in benchmarks/results/vs_trl_cpu.json.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_moe_gspo.yaml"
WORKER = ROOT / "benchmarks" / "workers" / "trl_grpo_worker.py"
PHASES = ("rollout", "old_logp", "train", "step")
TRL_VERSION = "1.16.0"  # setup.py's bench extra
COMMON = ["logging.wandb=false", "logging.plot=false"]


def trl_version(python: str) -> str | None:
    """TRL's version under `python`, or None when it does not import."""
    probe = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def env(threads: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONPATH": path}


def run(cmd: list[str], threads: int) -> tuple[str, float]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(threads), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout, time.perf_counter() - t


def warm_up(work: Path, threads: int) -> Path:
    """Our supervised warm-up of the demo (one RL step after it; the warm-up's export is what both start from)."""
    overrides = [f"trainer.output_dir={work / 'warm'}", f"model.hf_path={work / 'model'}", "trainer.steps=1"]
    overrides += ["data.eval=null", "data.eval_every=0", *COMMON]
    run([sys.executable, "-m", "megatron_rl.cli", "train", str(CONFIG), *overrides], threads)
    return work / "warm" / "warmup_model"


def run_ours(model: Path, work: Path, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(dir=work, prefix="ours-"))
    overrides = [
        f"trainer.output_dir={out}",
        f"model.hf_path={model}",
        "model.build_tiny_if_missing=false",
        "warmup.sft_steps=0",
        f"trainer.steps={args.steps}",
        f"data.eval_every={args.steps}",
        f"data.eval_prompts={args.eval_prompts}",
        "trainer.save_every=0",
        f"trainer.cpu_threads={args.threads}",  # the example's own would override --threads
        *COMMON,
    ]
    _, wall = run([sys.executable, "-m", "megatron_rl.cli", "train", str(CONFIG), *overrides], args.threads)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1 and "time/step" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return {
        "steps": [{p: r[f"time/{p}"] for p in PHASES} for r in steps],
        "generated_tokens": [r["rollout/response_len_mean"] * r["rollout/samples"] for r in steps],
        "reward_mean": [r["rollout/reward_mean"] for r in steps],
        "eval_accuracy": {"before": evals[0], "after": evals[-1]},
        "process_seconds": wall,
    }


def run_trl(model: Path, args: argparse.Namespace) -> dict:
    cmd = [args.trl_python, str(WORKER), "--model", str(model), "--steps", str(args.steps)]
    cmd += ["--eval-prompts", str(args.eval_prompts), "--threads", str(args.threads)]
    stdout, wall = run(cmd, args.threads)
    result = json.loads(stdout.rsplit("TRL_RESULT ", 1)[1].splitlines()[0])
    return {**result, "process_seconds": wall}


def summarise(run_: dict) -> dict:
    """Medians over steps 2.. of one run: seconds per phase and generated tokens/s."""
    steps, tokens = run_["steps"][1:], run_["generated_tokens"][1:]
    out = {p: statistics.median(s[p] for s in steps) for p in PHASES}
    out["tokens_per_s"] = statistics.median(n / s["step"] for n, s in zip(tokens, steps, strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run (the issue measured 30)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved pairs of runs (ours, TRL)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each framework")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts of the greedy accuracy")
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter that has TRL")
    parser.add_argument("--model", type=Path, help="a warmed-up HF model directory (default: warm up here)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vs_trl_cpu.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 of each run is left out)")

    version = trl_version(args.trl_python)
    if version is None:
        print(f"skipped: TRL does not import under {args.trl_python} (pip install -e .[bench], or --trl-python)")
        return
    if version != TRL_VERSION:
        print(f"note: TRL {version}, not the pinned {TRL_VERSION}")
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}", flush=True)
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or warm_up(work, args.threads)
        for k in range(args.repeats):
            for side in ("ours", "trl"):
                print(f"repeat {k + 1}/{args.repeats}: {side} ({args.steps} steps)", flush=True)
                runs[side].append(run_ours(model, work, args) if side == "ours" else run_trl(model, args))
    load_end = os.getloadavg()

    per_run = {side: [summarise(r) for r in rs] for side, rs in runs.items()}
    median = {side: {k: statistics.median(s[k] for s in rs) for k in rs[0]} for side, rs in per_run.items()}
    ratio = {k: median["ours"][k] / median["trl"][k] for k in median["ours"]}
    # Each interleaved pair's ratio: the spread the shared machine leaves.
    pair = {k: [o[k] / t[k] for o, t in zip(per_run["ours"], per_run["trl"], strict=True)] for k in ratio}
    print(f"\n{'per RL step (median)':<22}{'ours':>10}{'TRL':>10}{'ours/TRL':>10}   per pair")
    for k in (*PHASES, "tokens_per_s"):
        name = f"{k} ({'tok/s' if k == 'tokens_per_s' else 's'})"
        spread = " ".join(f"{x:.2f}" for x in pair[k])
        print(f"{name:<22}{median['ours'][k]:>10.4f}{median['trl'][k]:>10.4f}{ratio[k]:>10.2f}   {spread}")
    learning = {side: [r["eval_accuracy"] for r in rs] for side, rs in runs.items()}
    for side, accs in learning.items():
        print(f"greedy accuracy {side:>4}: " + ", ".join(f"{a['before']:.2f} -> {a['after']:.2f}" for a in accs))
    print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")

    command = "python benchmarks/bench_vs_trl.py " + " ".join(sys.argv[1:])
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, shared with other jobs",
        "load_average_start": load_start,
        "load_average_end": load_end,
        "command": command.strip(),
        "trl": version,
        "settings": {"steps": args.steps, "repeats": args.repeats, "threads": args.threads, "prompts": 8,
                     "samples": 8, "max_new_tokens": 16, "loss": "gspo 3e-4/4e-4", "updates_per_step": 2},
        "median": median,
        "ratio_ours_over_trl": ratio,
        "ratio_per_pair": pair,
        "per_run": per_run,
        "eval_accuracy": learning,
        "reward_mean_per_step": {side: [r["reward_mean"] for r in rs] for side, rs in runs.items()},
        "process_seconds": {side: [r["process_seconds"] for r in rs] for side, rs in runs.items()},
        "runs": runs,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
