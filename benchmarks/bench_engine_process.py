"""The local engine in the trainer's process (`LocalEngine`) against a child process (`ProcessEngine`), on the
demo's rollout (`examples/tiny_moe_gspo.yaml`: 8 prompts x 8 samples, 16 new tokens, temperature 1).

1. generate: one rollout batch, in-process vs in the child (interleaved, median of `--repeats`);
2. weight sync: `update_weights` of the whole model (the demo's one bucket), in-process vs through the child's
   shared-memory buffer;
3. overlap: `--rollouts` rollout batches in the child while the parent runs a compute loop standing in for a
   training step (small matmuls, Python-bound like the tiny demo's; `--work` sets its length; the parent keeps
   `--parent-threads`), against the two run one after the other; the same with the in-process engine on a
   thread, for contrast.

Timings on a shared machine are noisy: the load average is recorded, and ratios come from interleaved runs.
Run from the repository root:
    PYTHONPATH=. python benchmarks/bench_engine_process.py [--spec bench]
Results: a table on stdout and JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.engines.engine_process import ProcessEngine
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.rollout.tasks.synthetic_task import SyntheticTask
from megatron_rl.tiny_model import BENCH_SPEC, TinyQwen3MoeSpec, make_tiny_qwen3_moe

ROOT = Path(__file__).resolve().parents[1]
DEMO = SamplingParams(max_new_tokens=16, temperature=1.0)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compute_loop(steps: int) -> None:
    """A stand-in for a tiny model's training step: many small tensor ops, Python-bound."""
    x = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    for _ in range(steps):
        (grad,) = torch.autograd.grad(torch.tanh(x @ w).square().mean(), w)
        with torch.no_grad():
            w -= 1e-3 * grad


def cpu_seconds(child_pid: int) -> float:
    """CPU time so far of this process (every thread) and the engine process (from /proc)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    fields = Path(f"/proc/{child_pid}/stat").read_text().rsplit(")", 1)[1].split()
    return usage.ru_utime + usage.ru_stime + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overlapped(generate: Callable[[], object], steps: int, child_pid: int) -> tuple[float, float]:
    """Wall time of `generate` on a producer thread while this thread runs `compute_loop(steps)`, and the cores
    both processes used meanwhile (CPU seconds / wall seconds): below 1 when they run one at a time (the GIL, or
    a machine without a free core)."""
    cpu, start = cpu_seconds(child_pid), time.perf_counter()
    producer = threading.Thread(target=generate)
    producer.start()
    compute_loop(steps)
    producer.join()
    wall = time.perf_counter() - start
    return wall, (cpu_seconds(child_pid) - cpu) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", choices=["demo", "bench"], default="demo", help="demo model or BENCH_SPEC")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child-threads", type=int, default=1, help="torch threads of the engine process")
    parser.add_argument("--parent-threads", type=int, default=1, help="torch threads of the trainer's process")
    parser.add_argument("--work", type=float, default=1.0, help="compute loop length, in units of the rollouts")
    parser.add_argument("--rollouts", type=int, default=10, help="rollout batches per overlap measurement")
    args = parser.parse_args()

    load_before = os.getloadavg()
    model_dir = make_tiny_qwen3_moe(
        Path(tempfile.mkdtemp()) / "model", BENCH_SPEC if args.spec == "bench" else TinyQwen3MoeSpec(), seed=0
    )
    weights = sorted(load_file(model_dir / "model.safetensors").items())
    weight_mb = sum(t.nbytes for _, t in weights) / 2**20
    prompts = [p.token_ids for p in SyntheticTask(seed=0).prompts(8)]

    torch.set_num_threads(args.parent_threads)
    local = LocalEngine(model_dir)
    t0 = time.perf_counter()
    child = ProcessEngine(model_dir, torch_threads=args.child_threads)
    start_s = time.perf_counter() - t0
    engines: dict[str, RolloutEngine] = {"in_process": local, "child": child}

    def rollout(engine: RolloutEngine, batches: int = 1) -> Callable[[], object]:
        return lambda: [engine.generate(prompts, DEMO, n=8) for _ in range(batches)]

    for engine in engines.values():  # warm-up: first calls allocate
        rollout(engine)()
        engine.update_weights([weights], "warm")
    generate: dict[str, list[float]] = {name: [] for name in engines}
    sync: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats):
        for name, engine in engines.items():
            generate[name].append(seconds(rollout(engine)))
            sync[name].append(seconds(functools.partial(engine.update_weights, [weights], f"v{r}")))

    # calibrate the compute loop to `--work` rollouts of the child, then time each alone and overlapped
    one = seconds(lambda: compute_loop(200)) / 200
    steps = max(1, int(args.work * args.rollouts * statistics.median(generate["child"]) / one))
    overlap: dict[str, dict[str, list[float]]] = {
        name: {"generate": [], "compute": [], "overlapped": [], "cores": []} for name in engines
    }
    for _ in range(args.repeats):
        for name, engine in engines.items():
            overlap[name]["generate"].append(seconds(rollout(engine, args.rollouts)))
            overlap[name]["compute"].append(seconds(lambda: compute_loop(steps)))
            wall, cores = overlapped(rollout(engine, args.rollouts), steps, child.pid)
            overlap[name]["overlapped"].append(wall)
            overlap[name]["cores"].append(cores)
    child.shutdown()

    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in (("generate", generate), ("sync", sync))}
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "spec": args.spec,
        "weight_mb": round(weight_mb, 3),
        "prompts": len(prompts),
        "n": 8,
        "max_new_tokens": DEMO.max_new_tokens,
        "child_threads": args.child_threads,
        "parent_threads": args.parent_threads,
        "child_start_s": round(start_s, 2),
        "repeats": args.repeats,
        "generate_s": {n: round(v, 4) for n, v in med["generate"].items()},
        "sync_ms": {n: round(1e3 * v, 2) for n, v in med["sync"].items()},
        "rollouts_per_overlap": args.rollouts,
        "compute_steps": steps,
        "overlap": {},
    }
    for name, runs in overlap.items():
        m = {k: statistics.median(v) for k, v in runs.items()}
        sequential = m["generate"] + m["compute"]
        result["overlap"][name] = {
            **{f"{k}_s": round(v, 4) for k, v in m.items() if k != "cores"},
            "cores_used": round(m["cores"], 2),
            "sequential_s": round(sequential, 4),
            "speedup": round(sequential / m["overlapped"], 3),
        }
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}

    print(f"model {args.spec} ({weight_mb:.2f} MB fp32); child threads {args.child_threads}, "
          f"parent threads {args.parent_threads}; child start {start_s:.1f} s")  # fmt: skip
    print(f"{'':>12} {'generate s':>11} {'sync ms':>9} {'gen x' + str(args.rollouts):>10} {'compute':>8} {'both':>7} "
          f"{'speedup':>8} {'cores':>6}")  # fmt: skip
    for name in engines:
        o = result["overlap"][name]
        print(
            f"{name:>12} {result['generate_s'][name]:>11.4f} {result['sync_ms'][name]:>9.2f} "
            f"{o['generate_s']:>10.3f} {o['compute_s']:>8.3f} {o['overlapped_s']:>7.3f} {o['speedup']:>8.2f} "
            f"{o['cores_used']:>6.2f}"
        )
    print(f"load average before {load_before}, after {result['load_average']['after']}")
    date = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    dest = ROOT / "benchmarks" / "results" / f"engine_process_{args.spec}_{date}.json"
    dest.write_text(json.dumps(result, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
