"""What the CPU bridge costs a training step: torch-function calls and step time, per source tree.

Runs the tiny-MoE demo (`megatron-rl train examples/tiny_moe_gspo.yaml`, warm-up skipped, no evaluation,
no checkpoints) for `--steps` steps with each source tree given (default: this checkout), interleaved
`--repeats` times (A, B, A, B, ...) so that the shared machine's drift hits all trees alike, and reports
per tree the medians of the per-phase seconds (steps 2.., from metrics.jsonl), of the process CPU seconds
per step (steps 2.., the CPU clock read when each step is logged), the number of calls
that reached a torch-function mode's `__torch_function__` per step (every mode on the stack after
`bridge_cpu()` is counted; a tree without a process-wide mode reports 0) and the CPU seconds of the
whole run (imports and start-up included: less disturbed by other jobs than wall time).

    python benchmarks/bench_cpu_bridge.py [--steps 10] [--repeats 3] [--tree DIR ...] [key=value ...]
    python benchmarks/bench_cpu_bridge.py --generate [--repeats 3] [--tree DIR ...]

`--generate` times plain `transformers` generate (64 sampled sequences of 16 new tokens from the demo's
tiny model, runs/tiny_moe/model; one torch thread, process CPU seconds, which a shared machine disturbs
less than wall time) in one process per tree, before and after `bridge_cpu()`, and reports the median
ratio after/before: what the bridge costs code that never touches Megatron.

Compare against an older commit with a second worktree, e.g.
`git worktree add --detach /tmp/before <commit>` then `--tree /tmp/before --tree .`.
Results: a table on stdout and JSON in benchmarks/results/.
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
PHASES = ("time/step", "time/rollout", "time/old_logp", "time/train")
# Runs the CLI with a counter on every torch-function mode that bridge_cpu() leaves on the stack.
WRAPPER = """
import runpy, sys, torch
from megatron_rl.megatron_backend import platform
calls = [0]
original_bridge = platform.bridge_cpu
def bridge_cpu(*args, **kwargs):
    info = original_bridge(*args, **kwargs)
    for mode in torch.overrides._get_current_function_mode_stack():
        cls = type(mode)
        if getattr(cls, '_bench_counted', False):
            continue
        inner = cls.__torch_function__
        def counted(self, *a, _inner=inner, **k):
            calls[0] += 1
            return _inner(self, *a, **k)
        cls.__torch_function__ = counted
        cls._bench_counted = True
    return info
platform.bridge_cpu = bridge_cpu
import time
from megatron_rl.trainer.logs import run_log
logged = run_log.RunLog.log
def log(self, step, metrics):
    return logged(self, step, {**metrics, 'cpu/process_s': time.process_time()})
run_log.RunLog.log = log
sys.argv = ['megatron-rl', *sys.argv[1:]]
try:
    runpy.run_module('megatron_rl.cli', run_name='__main__')
finally:
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print('TORCH_FUNCTION_CALLS', calls[0], 'CPU_S', usage.ru_utime + usage.ru_stime, flush=True)
"""


GENERATE = """
import json, statistics, sys, time, torch, transformers
torch.set_num_threads(1)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
prompts = torch.randint(3, 12, (64, 8))
def timed():
    times = []
    for _ in range(5):
        t = time.process_time()
        with torch.no_grad():
            model.generate(prompts, max_new_tokens=16, min_new_tokens=16, do_sample=True, pad_token_id=0)
        times.append(time.process_time() - t)
    return statistics.median(times)
timed()  # warm-up
plain = timed()
from megatron_rl.megatron_backend import platform
platform.bridge_cpu()
print('GENERATE', json.dumps({"plain_s": plain, "bridged_s": timed()}), flush=True)
"""


def run_generate(tree: Path, model_dir: Path) -> dict[str, float]:
    """Seconds per generate call before and after bridge_cpu(), in one process."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", GENERATE, str(model_dir)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tree, env=env)
    result = json.loads(proc.stdout.rsplit("GENERATE", 1)[1])
    result["ratio"] = result["bridged_s"] / result["plain_s"]
    return result


def run_demo(tree: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    """Median per-phase seconds over steps 2.. and torch-function calls per step, for one run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable, "-c", WRAPPER, "train", str(ROOT / "examples" / "tiny_moe_gspo.yaml"),
            f"trainer.output_dir={out}", f"model.hf_path={Path(tmp) / 'model'}", f"trainer.steps={steps}",
            "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0", "trainer.save_every=0",
            "logging.wandb=false", "logging.plot=false", *overrides,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tree, env=env)
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in history if r["step"] > 1]
    result = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in PHASES}
    cpu = [r["cpu/process_s"] for r in history]
    result["step_cpu_s"] = statistics.median(b - a for a, b in zip(cpu, cpu[1:], strict=False))
    tail = proc.stdout.rsplit("TORCH_FUNCTION_CALLS", 1)[1].split()
    result["torch_function_calls_per_step"] = int(tail[0]) / steps
    result["process_cpu_s"] = float(tail[2])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", action="append", type=Path, help="source tree to run (repeatable)")
    parser.add_argument("--generate", action="store_true", help="time plain generate before/after bridge_cpu()")
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny_moe" / "model", help="for --generate")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = parser.parse_args()
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    runs: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    for repeat in range(args.repeats):
        for tree in trees:
            if args.generate:
                runs[str(tree)].append(run_generate(tree, args.model))
            else:
                runs[str(tree)].append(run_demo(tree, args.steps, args.overrides))
            print(f"repeat {repeat + 1}/{args.repeats} {tree}: {runs[str(tree)][-1]}", flush=True)
    if args.generate:
        keys = ("plain_s", "bridged_s", "ratio")
        summary = {tree: {k: statistics.median(r[k] for r in rs) for k in keys} for tree, rs in runs.items()}
        print(f"\nmedians of {args.repeats} runs: seconds per generate call before / after bridge_cpu()")
        for tree, row in summary.items():
            print(f"{tree:<40} plain {row['plain_s']:.4f}  bridged {row['bridged_s']:.4f}  ratio {row['ratio']:.3f}")
        write_results("cpu_bridge_generate", {"repeats": args.repeats, "runs": runs, "medians": summary})
        return
    keys = (*PHASES, "step_cpu_s", "torch_function_calls_per_step", "process_cpu_s")
    summary = {tree: {k: statistics.median(r[k] for r in rs) for k in keys} for tree, rs in runs.items()}
    print(f"\nmedians of {args.repeats} interleaved runs, {args.steps} steps each (step 1 left out of the phases)")
    names = ("step s", "rollout s", "old_logp s", "train s", "step CPU s", "tf calls/step", "run CPU s")
    print(f"{'tree':<40}" + "".join(f"{k:>14}" for k in names))
    for tree, row in summary.items():
        print(f"{tree:<40}" + "".join(f"{row[k]:>14.4g}" for k in keys))
    write_results("cpu_bridge", {"steps": args.steps, "repeats": args.repeats, "runs": runs, "medians": summary})


def write_results(name: str, data: dict) -> None:
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
