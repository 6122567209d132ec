"""The cost of routing replay in one training pass, at the actor level (no rollout, no loop noise).

One process (gloo, CPU here; CUDA when available), one batch, one model: a training update with natural routing
(`off`) against the same update replaying recorded routes, with the per-router-call check and the agreement
metric on (`replay`, the default), the check only (`check`), the metric only (`agreement`) and neither (`bare`).
Updates run at learning rate 0 (`warmup_step(lr=0)`), so every repetition trains the same weights; modes are
interleaved `--repeats` times and the median is reported as a ratio to `off`.

    python benchmarks/bench_replay_overhead.py --model demo     # the demo's tiny model
    python benchmarks/bench_replay_overhead.py --model large    # hidden 1024, 64 experts (top-8), 8 layers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "bare", "check", "agreement", "replay")


def build_model(kind: str, out: Path) -> Path:
    from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe

    if kind == "demo":
        return make_tiny_qwen3_moe(out, TinyQwen3MoeSpec(), seed=0)
    spec = TinyQwen3MoeSpec(
        hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
    )  # fmt: skip
    return make_tiny_qwen3_moe(out, spec, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["demo", "large"], default="demo")
    parser.add_argument("--batch", type=int, default=16, help="sequences per update")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from megatron_rl.config.options import ModelOptions, OptimizerOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.routing.replay import ReplayChecks

    layout = ParallelLayout()
    init_distributed(layout, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model, Path(tmp) / "model")
        actor = MegatronActor.from_hf(
            model, layout, model_options=ModelOptions(), optimizer_options=OptimizerOptions(lr=0.0, clip_grad=0.0),
            micro_batch_tokens=args.batch * args.seq // 2,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 120, (args.batch, args.seq), generator=gen)
    batch = TokenBatch(ids, torch.full((args.batch,), args.seq), torch.full((args.batch,), args.seq // 2))
    batch.routes = actor.compute_log_probs(batch, route_mode="record").routes

    def loss_fn(logp, _entropy, mb):
        mask = (torch.arange(logp.shape[1]) >= mb.response_start.unsqueeze(1)).to(logp.device)
        return -(logp * mask).sum(), mask.sum().to(torch.int), {}

    options = {
        "off": None,
        "bare": ReplayChecks(check=False, agreement=False),
        "check": ReplayChecks(check=True, agreement=False),
        "agreement": ReplayChecks(check=False, agreement=True),
        "replay": ReplayChecks(),
    }
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    for m in MODES:  # warm-up
        actor.warmup_step(batch, loss_fn, lr=0.0, route_mode=None if m == "off" else "replay", replay=options[m])
    for _ in range(args.repeats):
        for m in MODES:
            t = time.perf_counter()
            actor.warmup_step(batch, loss_fn, lr=0.0, route_mode=None if m == "off" else "replay", replay=options[m])
            seconds[m].append(time.perf_counter() - t)
    shutdown()
    med = {m: statistics.median(v) for m, v in seconds.items()}
    load = os.getloadavg()[0]
    print(f"model={args.model} batch={args.batch}x{args.seq} threads={torch.get_num_threads()} load={load:.1f}")
    print(f"{'mode':<10}{'update s':>10}{'x off':>8}")
    for m in MODES:
        print(f"{m:<10}{med[m]:>10.4f}{med[m] / med['off']:>8.3f}")
    out = ROOT / "benchmarks" / "results" / f"replay_overhead_{args.model}.json"
    out.write_text(json.dumps({"model": args.model, "median_s": med, "runs_s": seconds,
                               "ratio": {m: med[m] / med["off"] for m in MODES}}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
