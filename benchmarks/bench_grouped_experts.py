"""The local spec's MoE experts, forward + backward on CPU: Megatron's `SequentialMLP`, the grouped experts, and
transformers' Qwen3-MoE experts (what HF and TRL run).

    python benchmarks/bench_grouped_experts.py [--reps 15] [--threads 1 2] [--sizes demo bench medium mid large]

One process; per size, one experts module per variant with the same weights, the same routing of the same tokens
(every token to top-k distinct experts, uniformly, one expert given none) and the same output gradient.
Variants:
- `sequential`: Megatron's `SequentialMLP` (one `MLP` module per expert, in a Python loop);
- `grouped`: what `model.options.experts=auto|grouped` builds (`GroupedSequentialMLP`, its `auto` rule), and its
  two computations forced: `grouped_mm` (stacked weights, one `torch.nn.functional.grouped_mm` per projection,
  forward and backward) and `matmul_loop` (a loop of bare matmuls);
- `previous`: the same module with the projection of commit fd42c2d (`_previous_grouped_linear`: autograd through
  `torch._grouped_mm` of the stacked weights up to 65,536 elements per expert weight, the loop above), the A of
  this change's A/B;
- `hf_eager`, `hf_grouped_mm`: `transformers`' `Qwen3MoeExperts` with `experts_implementation` "eager" (its loop
  over the experts hit) and "grouped_mm" (its default, what TRL's `GRPOTrainer` runs). Their module also sorts the
  tokens by expert, gathers them and sums each token's top-k outputs (in Megatron the token dispatcher does that,
  outside the experts), so they do a little more than ours;
- `one_gemm_floor`: the grouped module with every route sent to one expert: the same FLOPs as one dense GEMM per
  projection (its fastest case on this CPU), the floor any grouping of these matmuls can approach. Not checked.
Sizes (hidden / expert ffn / experts / top-k, tokens): demo = examples/tiny_moe_gspo.yaml's model, bench =
`tiny_model.BENCH_SPEC`, medium = the P19 issue's 45 M model, mid and large for the CPU stacking threshold; 800
tokens (an update's 32 sequences of ~25 tokens), 512 at large. Repetitions interleave the variants (one round
each, in turn); per variant the median, min and max of the wall time and the median process CPU time are
reported. The outputs and input gradients of every variant are checked against `sequential` first (bitwise for
ours, 1e-5 relative for transformers'). Results: a table on stdout, benchmarks/results/grouped_experts_cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "grouped_experts_cpu.json"
# name -> (hidden, expert ffn, experts, top-k, tokens)
SIZES = {
    "demo": (64, 32, 8, 2, 800),
    "bench": (256, 128, 16, 2, 800),
    "medium": (384, 192, 32, 4, 800),
    "mid": (512, 256, 32, 4, 800),
    "large": (1024, 512, 64, 8, 512),
}
VARIANTS = (
    "sequential", "previous", "grouped", "grouped_mm", "matmul_loop", "hf_eager", "hf_grouped_mm", "one_gemm_floor",
)  # fmt: skip


def _previous_grouped_linear(
    x: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor], gemm: str = "auto"
) -> torch.Tensor:
    """The grouped experts' projection at commit fd42c2d, for the A/B."""
    if x.device.type == "cpu" and weights[0].numel() <= 1 << 16:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)
    groups = x.split(counts.tolist())
    return torch.cat([F.linear(group, w) for group, w in zip(groups, weights, strict=True)])


def build(hidden: int, ffn: int, experts: int, top_k: int) -> dict[str, torch.nn.Module]:
    """The variants' modules, all with the weights of one `SequentialMLP`."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from megatron_rl.megatron_backend.layers.grouped_experts import grouped_mlp_class

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=experts, moe_router_topk=top_k,
        moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True,
    )  # fmt: skip
    groups = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    modules: dict[str, torch.nn.Module] = {
        "sequential": SequentialMLP(experts, config, submodules, pg_collection=groups)
    }
    state = modules["sequential"].state_dict()
    gemms = {
        "previous": "auto", "grouped": "auto", "grouped_mm": "grouped_mm", "matmul_loop": "loop",
        "one_gemm_floor": "loop",
    }  # fmt: skip
    for variant, gemm in gemms.items():
        module = grouped_mlp_class()(experts, config, submodules, pg_collection=groups)
        module.load_state_dict(state)
        module.gemm = gemm
        modules[variant] = module
    experts_seq = modules["sequential"].local_experts
    for variant, implementation in (("hf_eager", "eager"), ("hf_grouped_mm", "grouped_mm")):
        hf_config = Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=ffn, num_experts=experts, num_experts_per_tok=top_k
        )
        hf_config._experts_implementation = implementation
        hf = Qwen3MoeExperts(hf_config)
        with torch.no_grad():  # Megatron's fc1 is [gate; up] as HF's gate_up_proj; fc2 is down_proj
            hf.gate_up_proj.copy_(torch.stack([e.linear_fc1.weight for e in experts_seq]))
            hf.down_proj.copy_(torch.stack([e.linear_fc2.weight for e in experts_seq]))
        modules[variant] = hf
    return modules


def routing(tokens: int, experts: int, top_k: int, hidden: int) -> dict[str, torch.Tensor]:
    """Tokens, their top-k experts and probabilities, and the same routes permuted by expert (Megatron's form)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 0] = -1.0  # expert 0 gets no token
    top_k_index = scores.topk(top_k, dim=-1).indices
    top_k_weights = torch.rand(tokens, top_k, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # routes grouped by expert, in token order within an expert
    return {
        "x": x,
        "top_k_index": top_k_index,
        "top_k_weights": top_k_weights,
        "order": order,
        "permuted_x": x[order // top_k],
        "permuted_probs": top_k_weights.reshape(-1)[order],
        "counts": flat.bincount(minlength=experts),
        "grad": torch.randn(tokens, hidden, generator=gen),
    }


def step(variant: str, module: torch.nn.Module, r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward; each token's summed top-k output and the gradient of the input tokens."""
    from megatron_rl.megatron_backend.layers import grouped_experts

    module.zero_grad(set_to_none=True)
    if variant == "previous":  # the module looks its projection up at call time
        current, grouped_experts._grouped_linear = grouped_experts._grouped_linear, _previous_grouped_linear
        try:
            return step("grouped", module, r)
        finally:
            grouped_experts._grouped_linear = current
    if variant == "one_gemm_floor":
        counts = torch.zeros_like(r["counts"])
        counts[1] = r["counts"].sum()
        return step("grouped", module, {**r, "counts": counts})
    if variant.startswith("hf_"):
        x = r["x"].clone().requires_grad_()
        out = module(x, r["top_k_index"], r["top_k_weights"])
        out.backward(r["grad"])
        return out.detach(), x.grad
    x = r["permuted_x"].clone().requires_grad_()
    routed, _ = module(x, r["counts"], r["permuted_probs"])
    grad_routed = r["grad"][r["order"] // r["top_k_index"].shape[1]]
    routed.backward(grad_routed)
    tokens, top_k = r["top_k_index"].shape
    summed = torch.zeros(tokens, routed.shape[1]).index_add_(0, r["order"] // top_k, routed.detach())
    grad_x = torch.zeros(tokens, routed.shape[1]).index_add_(0, r["order"] // top_k, x.grad)
    return summed, grad_x


def check(modules: dict[str, torch.nn.Module], r: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |difference| of each variant's outputs and input gradients from `sequential`'s, relative to their max."""
    ref_out, ref_grad = step("sequential", modules["sequential"], r)
    diffs = {}
    for variant in VARIANTS[1:-1]:
        out, grad = step(variant, modules[variant], r)
        rel = max(
            float((out - ref_out).abs().max() / ref_out.abs().max()),
            float((grad - ref_grad).abs().max() / ref_grad.abs().max()),
        )
        # Ours sum the top-k outputs outside the module, in the same order for every variant: bitwise.
        limit = 1e-5 if variant.startswith("hf_") else 0.0
        if rel > limit:
            raise RuntimeError(f"{variant} differs from sequential by {rel:.3g} (limit {limit})")
        diffs[variant] = rel
    return diffs


def measure(size: str, reps: int) -> dict[str, Any]:
    hidden, ffn, experts, top_k, tokens = SIZES[size]
    modules = build(hidden, ffn, experts, top_k)
    r = routing(tokens, experts, top_k, hidden)
    diffs = check(modules, r)
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps + 1):  # the first round warms up
        for variant in VARIANTS:
            w0, c0 = time.perf_counter(), time.process_time()
            step(variant, modules[variant], r)
            w1, c1 = time.perf_counter(), time.process_time()
            if rep:
                wall[variant].append((w1 - w0) * 1e3)
                cpu[variant].append((c1 - c0) * 1e3)
    return {
        "max_rel_diff_vs_sequential": diffs,
        "results": {
            v: {
                "wall_ms_median": statistics.median(wall[v]),
                "wall_ms_min": min(wall[v]),
                "wall_ms_max": max(wall[v]),
                "cpu_ms_median": statistics.median(cpu[v]),
            }
            for v in VARIANTS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    init_distributed(ParallelLayout(), seed=0)
    load_before = os.getloadavg()
    runs = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        runs[str(threads)] = {}
        for size in args.sizes:
            runs[str(threads)][size] = measure(size, args.reps)
            print(f"{threads} thread(s), {size}: done (load {os.getloadavg()[0]:.1f})", flush=True)
    load_after = os.getloadavg()
    shutdown()
    for threads, sizes in runs.items():
        print(f"{threads} thread(s): median wall ms [min-max], forward + backward")
        print(f"{'size':7s} " + " ".join(f"{v:>21s}" for v in VARIANTS))
        for size, row in sizes.items():
            cells = [row["results"][v] for v in VARIANTS]
            text = [f"{c['wall_ms_median']:8.2f} [{c['wall_ms_min']:.1f}-{c['wall_ms_max']:.1f}]" for c in cells]
            print(f"{size:7s} " + " ".join(t.rjust(21) for t in text))
        print(f"{threads} thread(s): median process CPU ms")
        for size, row in sizes.items():
            print(f"{size:7s} " + " ".join(f"{row['results'][v]['cpu_ms_median']:21.2f}" for v in VARIANTS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_grouped_experts.py "
        + f"--reps {args.reps} --threads {' '.join(map(str, args.threads))} --sizes {' '.join(args.sizes)}",
        "torch": torch.__version__,
        "reps": args.reps,
        "load_1_5_15min_before_after": [load_before, load_after],
        "sizes": {
            k: dict(zip(("hidden", "ffn", "experts", "top_k", "tokens"), SIZES[k], strict=True)) for k in args.sizes
        },
        "runs_by_threads": runs,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
