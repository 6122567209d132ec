"""The grouped experts (`model.options.experts=grouped`) against Megatron's `SequentialMLP` on one model.

Usage: python -m torch.distributed.run --nproc_per_node 2 grouped_experts_check.py MODEL_DIR OUT_DIR

Under torchrun it runs each layout of `LAYOUTS` in turn (re-initialising Megatron's parallel state between them)
and writes OUT_DIR/rank{R}.json: per layout, what `compare_experts` measured on that rank. The single-process test
(tests/megatron_backend/layers/test_grouped_experts.py) imports `compare_experts` itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatron_rl.megatron_backend import platform
from megatron_rl.parallel_layout import ParallelLayout

# Two ranks: the experts split over EP (4 local experts each, tokens moved by the all-to-all dispatcher), and
# TP=2 with expert TP 2 (each expert's fc1/fc2 split in two, sequence parallel).
LAYOUTS = {"ep2": ParallelLayout(ep=2), "tp2_etp2": ParallelLayout(tp=2)}


def _build(model_dir: Path, layout: ParallelLayout, experts: str, dtype: str) -> torch.nn.Module:
    from megatron_rl.config.options import ModelOptions
    from megatron_rl.megatron_backend.actor.model_builder import build_model
    from megatron_rl.megatron_backend.weights.hf_weights import load_hf_weights
    from megatron_rl.models.family import get_family

    hf = json.loads((model_dir / "config.json").read_text())
    chunks, _ = build_model(hf, layout, ModelOptions(experts=experts, dtype=dtype))
    load_hf_weights(chunks, model_dir, get_family(hf), hf)
    return chunks[0]


def _sharded_layout(model: torch.nn.Module) -> dict[str, tuple]:
    """Every sharded-state-dict entry's checkpoint key, global shape and offset (what a checkpoint records)."""
    fields = ("key", "global_shape", "global_offset")
    return {name: tuple(getattr(item, f, None) for f in fields) for name, item in model.sharded_state_dict().items()}


def _run(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict, list[int]]:
    """Logits of each batch, the parameters' gradients of a fixed linear function of all logits, and every
    experts module call's number of local experts that got no token."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    empty: list[int] = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: empty.append(int((args[1] == 0).sum())))
        for m in model.modules()
        if isinstance(m, SequentialMLP)
    ]
    model.zero_grad(set_to_none=True)
    outputs = []
    for i, ids in enumerate(batches):
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        logits = model(ids, positions, attention_mask=None)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(100 + i))
        (logits.float() * weights).sum().backward()
        outputs.append(logits.detach().float())
    for hook in hooks:
        hook.remove()
    grads = {name: p.grad.detach().float() for name, p in model.named_parameters() if p.grad is not None}
    return outputs, grads, empty


def compare_experts(model_dir: Path, layout: ParallelLayout, dtype: str, batches: list[torch.Tensor]) -> dict:
    """Sequential vs grouped experts on the same weights and batches (this rank's view): the max |difference| of
    the logits and of every parameter's gradient (absolute, and relative to that gradient's max |value|), whether
    the parameter names and the sharded state dicts are identical, and how many grouped-experts calls had a
    local expert without tokens."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    sequential = _build(model_dir, layout, "sequential", dtype)
    grouped = _build(model_dir, layout, "grouped", dtype)
    kinds = {type(m) for m in grouped.modules() if isinstance(m, SequentialMLP)}
    seq_logits, seq_grads, _ = _run(sequential, batches)
    grp_logits, grp_grads, empty = _run(grouped, batches)
    grad_abs = {n: float((seq_grads[n] - grp_grads[n]).abs().max()) for n in seq_grads}
    grad_rel = {n: d / max(float(seq_grads[n].abs().max()), 1e-30) for n, d in grad_abs.items()}
    return {
        "grouped_class": sorted(k.__name__ for k in kinds),
        "logits": max(float((a - b).abs().max()) for a, b in zip(seq_logits, grp_logits, strict=True)),
        "logits_scale": max(float(a.abs().max()) for a in seq_logits),
        "grad_abs": max(grad_abs.values()),
        "grad_rel": max(grad_rel.values()),
        "worst_grad": max(grad_rel, key=grad_rel.__getitem__),
        "same_grad_names": sorted(seq_grads) == sorted(grp_grads),
        "same_names": [n for n, _ in sequential.named_parameters()] == [n for n, _ in grouped.named_parameters()],
        "same_state_dict": list(sequential.state_dict()) == list(grouped.state_dict()),
        "same_sharded": _sharded_layout(sequential) == _sharded_layout(grouped),
        "calls_with_an_empty_expert": sum(1 for n in empty if n > 0),
        "calls": len(empty),
    }


def batches_for(seed: int, tp: int, vocab: int) -> list[torch.Tensor]:
    """A [2, 12] batch, and [1, tp]: tp tokens x top-2 < 8 experts, so some expert of every MoE layer gets none
    (sequence lengths divisible by TP, as sequence parallelism needs)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (2, 12), generator=gen), torch.randint(4, vocab, (1, tp), generator=gen)]


def main(model_dir: str, out_dir: str) -> None:
    platform.prepare_megatron_import()
    torch._dynamo.config.disable = True  # Megatron's jit_fuser: compile time for nothing at these sizes
    from megatron.core import parallel_state as ps

    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    results = {}
    for name, layout in LAYOUTS.items():
        init_distributed(layout, seed=1234)
        batches = batches_for(ps.get_data_parallel_rank(), layout.tp, vocab)
        results[name] = compare_experts(Path(model_dir), layout, "fp32", batches)
        ParallelLayout.destroy()
    rank = torch.distributed.get_rank()
    shutdown()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
