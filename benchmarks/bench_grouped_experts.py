"""The local spec's MoE experts: Megatron's `SequentialMLP` against the grouped experts, forward + backward on CPU.

    python benchmarks/bench_grouped_experts.py [--reps 7] [--threads 1]

One process, one MoE experts module per variant with the same weights, the same permuted tokens (one expert
given none) and the same output gradient. Variants: `sequential` (Megatron's per-expert loop), `grouped` (what
`model.options.experts=grouped|auto` builds: `torch._grouped_mm` for small expert weights, a loop of bare
matmuls for large ones), and its two computations forced (`grouped_mm`: stacked weights + `torch._grouped_mm`
at every size; `matmul_loop`). Sizes: the demo's experts (examples/tiny_moe_gspo.yaml: hidden 64, expert ffn 32,
8 experts, top-2; an update's 32 sequences of ~25 tokens), a mid size, and a large one (hidden 1024, ffn 512,
64 experts, top-8). Repetitions are interleaved across variants; the minimum per variant is reported (the
machine is shared). Results: a table on stdout and benchmarks/results/grouped_experts_cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "grouped_experts_cpu.json"
# name -> (hidden, expert ffn, experts, top-k, tokens)
SIZES = {
    "demo": (64, 32, 8, 2, 800),
    "mid": (512, 256, 32, 4, 800),
    "large": (1024, 512, 64, 8, 512),
}
VARIANTS = ("sequential", "grouped", "grouped_mm", "matmul_loop")


def build(hidden: int, ffn: int, experts: int, top_k: int) -> dict[str, torch.nn.Module]:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_rl.megatron_backend.models.grouped_experts import grouped_mlp_class

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=experts, moe_router_topk=top_k,
        moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True,
    )  # fmt: skip
    groups = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    sequential = SequentialMLP(experts, config, submodules, pg_collection=groups)
    grouped = grouped_mlp_class()(experts, config, submodules, pg_collection=groups)
    grouped.load_state_dict(sequential.state_dict())
    return {"sequential": sequential, "grouped": grouped, "grouped_mm": grouped, "matmul_loop": grouped}


def measure(size: str, reps: int) -> dict[str, dict[str, float]]:
    from megatron_rl.megatron_backend.models import grouped_experts

    hidden, ffn, experts, top_k, tokens = SIZES[size]
    modules = build(hidden, ffn, experts, top_k)
    gen = torch.Generator().manual_seed(0)
    routed = tokens * top_k
    counts = torch.multinomial(torch.ones(experts), routed, replacement=True, generator=gen).bincount(minlength=experts)
    counts[1] += counts[0]
    counts[0] = 0  # an expert without tokens
    x = torch.randn(routed, hidden, generator=gen)
    probs = torch.rand(routed, generator=gen)
    grad = torch.randn(routed, hidden, generator=gen)
    stack_max = {"grouped": grouped_experts.STACK_MAX_NUMEL, "grouped_mm": 1 << 62, "matmul_loop": -1}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(reps + 1):  # the first round warms up
        for variant in VARIANTS:
            module = modules[variant]
            grouped_experts.STACK_MAX_NUMEL = stack_max.get(variant, 0)
            module.zero_grad(set_to_none=True)
            inputs = x.clone().requires_grad_()
            t0 = time.perf_counter()
            out, _ = module(inputs, counts, probs)
            t1 = time.perf_counter()
            out.backward(grad)
            t2 = time.perf_counter()
            if variant in best and best[variant][0] + best[variant][1] <= t2 - t0:
                continue
            best[variant] = (t1 - t0, t2 - t1)
    grouped_experts.STACK_MAX_NUMEL = stack_max["grouped"]
    return {v: {"forward_ms": f * 1e3, "backward_ms": b * 1e3, "total_ms": (f + b) * 1e3} for v, (f, b) in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.megatron_backend.parallel_layout import ParallelLayout

    init_distributed(ParallelLayout(), seed=0)
    load_before = os.getloadavg()[0]
    results = {size: measure(size, args.reps) for size in SIZES}
    shutdown()
    print(f"{'size':6s} " + " ".join(f"{v:>22s}" for v in VARIANTS) + "   (forward + backward, ms)")
    for size, row in results.items():
        print(f"{size:6s} " + " ".join(f"{row[v]['total_ms']:22.2f}" for v in VARIANTS))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "torch": torch.__version__,
                "threads": args.threads,
                "reps": args.reps,
                "load_before_after": [load_before, os.getloadavg()[0]],
                "sizes": {
                    k: dict(zip(("hidden", "ffn", "experts", "top_k", "tokens"), v, strict=True))
                    for k, v in SIZES.items()
                },
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
