"""The experts' GEMM rule in the trainer's own passes: grouped GEMM against the loop of matmuls, per model size.

`grouped_experts._grouped_linear` takes the grouped GEMM (stacking every expert's weight on each call) or a loop of
one matmul per expert. This times both inside a real `MegatronActor` built for training (its weights in Megatron's
DDP buffer, as in `megatron-rl train`), at the demo task's shapes: a scoring forward with entropy (the old-log-prob
pass) and an update of the same micro-batch (forward, backward and an optimizer step at learning rate 0, as
`warmup_step` runs it: the weights stay), of 32 samples of `--lengths` tokens. The two are interleaved in one
process, in turn first (A B, B A, ...), `--reps` rounds after one warm-up; medians in ms.

    python benchmarks/bench_experts_gemm.py --specs demo bench medium --threads 1 2
Results: a table on stdout and benchmarks/results/experts_gemm_cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results" / "experts_gemm_cpu.json"
GEMMS = ("grouped_mm", "loop")


def measure(spec_name: str, threads: list[int], lengths: tuple[int, int], reps: int) -> dict:
    from bench_vs_trl import SPECS

    from megatron_rl.config.options import ModelOptions, OptimizerOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.tiny_model import make_tiny_qwen3_moe
    from megatron_rl.trainer.warmup import sft_loss

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_qwen3_moe(Path(tmp) / "model", SPECS[spec_name], seed=1234)
        dims = model_dims(read_hf_config(model_dir))
        init_distributed(ParallelLayout(), seed=0, dims=dims)
        try:
            options = {"model_options": ModelOptions(dtype="fp32"), "optimizer_options": OptimizerOptions()}
            actor = MegatronActor.from_hf(model_dir, ParallelLayout(), **options)
            experts = [m for chunk in actor.chunks for m in chunk.modules() if hasattr(m, "gemm")]
            generator = torch.Generator().manual_seed(0)
            lens = torch.randint(lengths[0], lengths[1] + 1, (32,), generator=generator)
            ids = torch.randint(0, dims.vocab_size, (32, int(lens.max())), generator=generator)
            positions = torch.arange(ids.shape[1])
            mask = ((positions >= (lens // 2)[:, None]) & (positions < lens[:, None])).float()
            batch = TokenBatch(input_ids=ids, lengths=lens, response_start=lens // 2, fields={"loss_mask": mask})
            passes = {
                "score": lambda: actor.compute_log_probs(batch, with_entropy=True),
                "update": lambda: actor.warmup_step(batch, sft_loss, lr=0.0),
            }
            out: dict = {}
            for n in threads:
                torch.set_num_threads(n)
                times: dict = {(p, g): [] for p in passes for g in GEMMS}
                for rep in range(reps + 1):
                    for name, run in passes.items():
                        for gemm in GEMMS if rep % 2 else GEMMS[::-1]:  # ABBA: neither always runs first
                            for module in experts:
                                module.gemm = gemm
                            start = time.perf_counter()
                            run()
                            if rep:
                                times[name, gemm].append((time.perf_counter() - start) * 1e3)
                out[str(n)] = {f"{p}/{g}": statistics.median(v) for (p, g), v in times.items()}
        finally:
            shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=["demo", "bench", "medium"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--lengths", type=int, nargs=2, default=(8, 12), help="sample lengths, min and max")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    load = os.getloadavg()
    rows = {spec: measure(spec, args.threads, tuple(args.lengths), args.reps) for spec in args.specs}
    print(f"ms, median of {args.reps} (32 samples of {args.lengths[0]}-{args.lengths[1]} tokens)")
    print(f"{'spec':8}{'threads':>8}{'score grouped':>15}{'score loop':>12}{'update grouped':>17}{'update loop':>14}")
    for spec, by_threads in rows.items():
        for n, r in by_threads.items():
            cells = [r[f"{p}/{g}"] for p in ("score", "update") for g in GEMMS]
            print(f"{spec:8}{n:>8}" + "".join(f"{c:>{w}.1f}" for c, w in zip(cells, (15, 12, 17, 14), strict=True)))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_experts_gemm.py --specs " + " ".join(args.specs)
        + f" --threads {' '.join(map(str, args.threads))} --lengths {args.lengths[0]} {args.lengths[1]}"
        + f" --reps {args.reps}",
        "load_1_5_15min_before_after": [load, os.getloadavg()],
        "ms_median": rows,
    }  # fmt: skip
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
