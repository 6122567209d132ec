"""Sync vs asynchronous RL on the embedded demo (P15): wall time, samples/s, idle time and held-out accuracy.

Four runs train the same number of samples from the same warmed-up model (the demo's settings: 8 prompts x 8
samples, 16 tokens, GSPO, two updates per step):

* ``sync``: `trainer.mode=sync`, the local engine in the trainer's process (the default), on the example's one
  trainer thread (`trainer.cpu_threads: 1`, the fastest for this tiny model), and as ``sync_2threads`` on torch's
  default (one per core);
* ``async``: `trainer.mode=async`, `max_staleness=1`, the engine in its own process (`rollout.engine_process=auto`)
  on its own thread (`rollout.engine_threads: 1`), the trainer on one;
* ``async_partial``: the same with `rollout.partial=true`.

Each mode is a `megatron-rl train` run of its own; modes are interleaved `--repeats` times. The loop's time is the
sum of `time/step` (start-up, the warm-up and evaluations excluded); idle time per step: the trainer waits for
samples (sync: the whole rollout; async: `async/trainer_wait_s`), the engine waits for weights (sync: everything
but the rollout; async: `async/engine_wait_s`). Reward curves over samples go to a PNG.

    python benchmarks/bench_async.py [--steps 60] [--repeats 2]
Results: a table on stdout, JSON and a PNG in benchmarks/results/async_<date>.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_moe_gspo.yaml"
MODES = {
    "sync": ("trainer.mode=sync",),
    "sync_2threads": ("trainer.mode=sync", "trainer.cpu_threads=0"),
    "async": ("trainer.mode=async", "trainer.max_staleness=1"),
    "async_partial": ("trainer.mode=async", "trainer.max_staleness=1", "rollout.partial=true"),
}
COMMON = ("logging.wandb=false", "logging.plot=false", "trainer.save_every=0", "data.eval=synthetic",
          "data.eval_prompts=128")  # fmt: skip


def _train(out: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}", *COMMON,
           *overrides]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _warmed_model(work: Path) -> Path:
    """The demo's warm-up (150 supervised steps) once; every mode starts from its result."""
    out = work / "warmup"
    _train(out, f"model.hf_path={work / 'model'}", "model.build_tiny_if_missing=true", "trainer.steps=1",
           "data.eval_every=1")  # fmt: skip
    return out / "warmup_model"


def _summary(rows: list[dict], mode: str) -> dict:
    steps = [r for r in rows if r["step"] > 0]
    loop_s = sum(r["time/step"] for r in steps)
    samples = sum(r["rollout/samples"] for r in steps)
    if mode.startswith("sync"):
        trainer_idle = [r["time/rollout"] for r in steps]
        engine_idle = [r["time/step"] - r["time/rollout"] for r in steps]
    else:
        trainer_idle = [r["async/trainer_wait_s"] for r in steps]
        engine_idle = [r["async/engine_wait_s"] for r in steps]
    return {
        "loop_s": loop_s,
        "samples": samples,
        "samples_per_s": samples / loop_s,
        "trainer_idle_s_per_step": statistics.mean(trainer_idle),
        "engine_idle_s_per_step": statistics.mean(engine_idle),
        "final_accuracy": steps[-1]["eval/accuracy"],
        "start_accuracy": rows[0]["eval/accuracy"],
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in steps),
        "partial_share": statistics.mean(r.get("async/partial_share", 0.0) for r in steps),
        "rewards": [r["rollout/reward_mean"] for r in steps],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of a results JSON written before")
    parser.add_argument("--sglang", action="store_true", help="sync vs async against one real SGLang server (CPU)")
    args = parser.parse_args()
    if args.plot:
        _plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    if args.sglang:
        _sglang(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = _warmed_model(work)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode, overrides in MODES.items():
                out = work / f"{mode}_{repeat}"
                rows = _train(out, f"model.hf_path={model}", "warmup.sft_steps=0", f"trainer.steps={args.steps}",
                              f"data.eval_every={args.steps}", *overrides)  # fmt: skip
                runs[mode].append(_summary(rows, mode))
                print(f"{mode} #{repeat}: {runs[mode][-1]['samples_per_s']:.0f} samples/s", flush=True)
    result: dict = {"steps": args.steps, "repeats": args.repeats, "load": os.getloadavg(), "modes": {}}
    base = statistics.median(r["samples_per_s"] for r in runs["sync"])
    print(f"\n{'mode':15s} {'samples/s':>10s} {'vs sync':>8s} {'trainer idle':>13s} {'engine idle':>12s} "
          f"{'accuracy':>9s} {'stale':>6s} {'partial':>8s}")  # fmt: skip
    for mode, summaries in runs.items():
        med = {k: statistics.median(s[k] for s in summaries) for k in summaries[0] if k != "rewards"}
        med["ratio_vs_sync"] = med["samples_per_s"] / base
        med["rewards"] = summaries[0]["rewards"]
        result["modes"][mode] = med
        print(f"{mode:15s} {med['samples_per_s']:10.0f} {med['ratio_vs_sync']:8.2f} "
              f"{med['trainer_idle_s_per_step']:12.3f}s {med['engine_idle_s_per_step']:11.3f}s "
              f"{med['final_accuracy']:9.3f} {med['staleness_mean']:6.2f} {med['partial_share']:8.2f}")  # fmt: skip
    stamp = datetime.date.today().strftime("%Y%m%d")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"async_{stamp}.json").write_text(json.dumps(result, indent=1))
    _plot(result, args.out / f"async_{stamp}.png")
    print(f"\nresults: {args.out / f'async_{stamp}.json'} (+ .png); load {result['load'][0]:.1f}")


def _sglang(args: argparse.Namespace) -> None:
    """Sync vs async with the rollouts on a real SGLang server (tests/sglang's CPU setup, fp32, the trainer's weights
    broadcast to it after every step): the same medians, 2 modes."""
    sys.path.insert(0, str(ROOT / "tests" / "sglang"))
    from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env, sglang_python

    from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers

    python = sglang_python()
    if python is None:
        print("no SGLang venv (bash scripts/install_sglang_cpu.sh): nothing measured")
        return
    modes = {"sglang_sync": ("trainer.mode=sync",), "sglang_async": ("trainer.mode=async",)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = _warmed_model(work)
        args_ = list(CPU_SERVER_ARGS)
        args_[args_.index("--dtype") + 1] = "float32"
        log_dir = str(work / "logs")
        config = SGLangLaunchConfig(model_path=str(model), python=python, extra_args=tuple(args_),
                                    env=cpu_launch_env(), log_dir=log_dir, startup_timeout_s=240)  # fmt: skip
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        with SGLangServers.launch(config) as servers:
            server = ("rollout.engine=sglang", f"rollout.sglang.urls=[{servers.urls[0]}]",
                      f"rollout.sglang.api_key_file={servers.api_key_file}", "trainer.colocate=false",
                      "rollout.weight_sync=distributed")  # fmt: skip
            for repeat in range(args.repeats):
                for mode, overrides in modes.items():
                    rows = _train(work / f"{mode}_{repeat}", f"model.hf_path={model}", "warmup.sft_steps=0",
                                  f"trainer.steps={args.steps}", f"data.eval_every={args.steps}", *server,
                                  *overrides)  # fmt: skip
                    runs[mode].append(_summary(rows, mode.removeprefix("sglang_"))["samples_per_s"])
                    print(f"{mode} #{repeat}: {runs[mode][-1]:.0f} samples/s", flush=True)
    sync, async_ = statistics.median(runs["sglang_sync"]), statistics.median(runs["sglang_async"])
    print(f"SGLang server: sync {sync:.0f}, async {async_:.0f} samples/s: {async_ / sync:.2f}x "
          f"(load {os.getloadavg()[0]:.1f})")  # fmt: skip


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    window = 5  # steps: the per-step reward of 64 samples is noisy
    for mode, med in result["modes"].items():
        rewards = med["rewards"]
        per_step = med["samples"] / len(rewards)
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
                  for i in range(len(rewards))]  # fmt: skip
        ax.plot([per_step * (i + 1) for i in range(len(rewards))], smooth,
                label=f"{mode} ({med['samples_per_s']:.0f} samples/s, acc {med['final_accuracy']:.2f})")  # fmt: skip
    ax.set_xlabel("samples trained")
    ax.set_ylabel(f"rollout reward ({window}-step mean)")
    ax.set_title("embedded demo: sync vs async (max_staleness=1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
