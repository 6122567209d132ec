"""Train the tiny MoE GPT for a few steps under several parallel layouts in one torchrun job.

    python -m torch.distributed.run --nproc_per_node 2 smoke_layouts.py --out r.json \
        --layouts tp2_sp,ep2,pp2,pp2_vpp2,dp2_distopt
    python smoke_layouts.py --out ref.json --layouts ref       # the single-process reference

Every layout starts from the same layout-independent weights and the same fixed batch, so
its loss and grad-norm trajectory must equal the single-process one. Rank 0 writes
{layout: {"loss": [...], "grad_norm": [...], ...}, "_cuda_hits": {...}} as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist_harness

import torch  # noqa: E402

from megatron_rl.megatron_backend import platform  # noqa: E402

platform.prepare_megatron_import()

import dist_harness  # noqa: E402

from megatron_rl.megatron_backend.distributed import init_distributed, shutdown  # noqa: E402
from megatron_rl.parallel_layout import ParallelLayout  # noqa: E402

# name -> (layout, use the distributed optimizer)
LAYOUTS: dict[str, tuple[ParallelLayout, bool]] = {
    "ref": (ParallelLayout(), False),
    "tp2_sp": (ParallelLayout(tp=2), False),
    "ep2": (ParallelLayout(ep=2), False),
    "pp2": (ParallelLayout(pp=2), False),
    "pp2_vpp2": (ParallelLayout(pp=2, vpp=2), False),
    "dp2_distopt": (ParallelLayout(), True),
}
MODEL = dist_harness.SMOKE_MODEL


def logprob_parity(trainer: dist_harness.Trainer, tokens: torch.Tensor) -> float:
    """Max |log-prob from vocab_parallel_cross_entropy - log_softmax of the gathered logits|."""
    from megatron.core import tensor_parallel

    model = trainer.chunks[0]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    with torch.no_grad():
        logits = model(inputs, positions, attention_mask=None)  # [b, s, vocab / tp]
        megatron_lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        reference = torch.log_softmax(full, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return float((megatron_lp - reference).abs().max())


def run_layout(name: str, steps: int, seed: int, megatron_init: bool) -> dict:
    layout, distopt = LAYOUTS[name]
    init_distributed(layout, seed=seed)
    sizes = {"num_layers": MODEL.num_layers, "num_experts": MODEL.num_experts}
    layout.validate(torch.distributed.get_world_size(), **sizes, num_attention_heads=MODEL.num_attention_heads)
    start = time.perf_counter()
    trainer = dist_harness.make_trainer(
        MODEL, layout, seed=seed, distributed_optimizer=distopt, layout_independent_init=not megatron_init
    )
    tokens = MODEL.token_batches(steps, seed)
    result = dist_harness.train(trainer, tokens)
    if layout.pp == 1:
        result["logprob_max_abs_diff"] = logprob_parity(trainer, tokens[0, : MODEL.micro_batch])
    result["seconds"] = time.perf_counter() - start
    ParallelLayout.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSON result path (rank 0 writes it)")
    parser.add_argument("--layouts", default="ref", help=f"comma-separated, from {sorted(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--megatron-init",
        action="store_true",
        help="keep Megatron's own CPU init instead of the layout-independent one (PP/EP then differ)",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch._dynamo.config.disable = True  # jit_fuser is torch.compile: seconds of compile, no gain here
    results = {name: run_layout(name, args.steps, args.seed, args.megatron_init) for name in args.layouts.split(",")}
    results["_cuda_hits"] = platform.cuda_hits()
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(results, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
