"""Operator counts of one scoring forward: our Megatron actor against transformers on the same samples.

At the demo's sizes a forward is a few milliseconds, so its cost is the host's per-operator work (Python,
dispatch, allocation), not arithmetic. This counts the ATen operators each side dispatches for the same batch
(`torch.profiler`, CPU), which does not depend on the machine's load, and reports their CPU self time too.

Ours: `MegatronActor.compute_log_probs` with entropy (the old-log-prob pass of the trainer, one packed
micro-batch). Theirs: `AutoModelForCausalLM` forward of the batch padded to its longest sample, then
log-softmax and gather (what TRL's `_get_per_token_logps_and_entropies` does; with entropy). The model is the
project's tiny Qwen3-MoE at `--spec` (bench_vs_trl.py's sizes), fp32, one thread.

    python benchmarks/bench_op_counts.py --spec demo --samples 32
Results: a table on stdout (operators per forward, per layer, and the most frequent ones on each side).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def profile_ops(fn, repeats: int) -> tuple[collections.Counter, float]:
    """ATen operator counts of one call of `fn` (after a warm-up call) and its mean CPU self time in ms."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    counts: collections.Counter = collections.Counter()
    self_us = 0.0
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            counts[event.key] += event.count // repeats
            self_us += event.self_cpu_time_total
    return counts, self_us / repeats / 1e3


def main() -> None:
    from bench_vs_trl import SPECS

    from megatron_rl.config.options import ModelOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.tiny_model import make_tiny_qwen3_moe

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", choices=sorted(SPECS), default="demo")
    parser.add_argument("--samples", type=int, default=32, help="samples in the batch (the demo's mini-batch: 32)")
    parser.add_argument("--length", type=int, default=30, help="tokens per sample (the demo's: ~20-40)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="most frequent operators listed per side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = SPECS[args.spec]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_qwen3_moe(Path(tmp) / "model", spec, seed=1234)
        hf_config = read_hf_config(model_dir)
        dims = model_dims(hf_config)
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(args.length * 2 // 3, args.length * 4 // 3 + 1, (args.samples,), generator=generator)
        width = int(lengths.max())
        ids = torch.randint(0, dims.vocab_size, (args.samples, width), generator=generator)
        ids = torch.where(torch.arange(width) < lengths[:, None], ids, 0)

        layout = ParallelLayout()
        init_distributed(layout, seed=0, dims=dims)
        try:
            actor = MegatronActor.from_hf(model_dir, layout, model_options=ModelOptions(dtype="fp32"))
            batch = TokenBatch(input_ids=ids, lengths=lengths, response_start=lengths // 2)
            ours, ours_ms = profile_ops(lambda: actor.compute_log_probs(batch, with_entropy=True), args.repeats)
        finally:
            shutdown()

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        attention = (torch.arange(width) < lengths[:, None]).long()

        @torch.no_grad()
        def theirs_forward() -> None:
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            logp = torch.log_softmax(logits, dim=-1)
            logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-(logp.exp() * logp).sum(-1))

        theirs, theirs_ms = profile_ops(theirs_forward, args.repeats)

    layers = dims.num_layers
    tokens = int(lengths.sum())
    print(f"{args.spec}: {layers} layers, {args.samples} samples, {tokens} tokens ({args.samples * width} padded)")
    print(f"{'':<28}{'ours':>10}{'transformers':>14}")
    print(f"{'ATen operators / forward':<28}{sum(ours.values()):>10}{sum(theirs.values()):>14}")
    print(f"{'  / layers':<28}{sum(ours.values()) / layers:>10.0f}{sum(theirs.values()) / layers:>14.0f}")
    print(f"{'ATen CPU self time (ms)':<28}{ours_ms:>10.2f}{theirs_ms:>14.2f}")
    for name, counts in (("ours", ours), ("transformers", theirs)):
        print(f"\nmost frequent ({name}): " + ", ".join(f"{k[6:]} {v}" for k, v in counts.most_common(args.top)))


if __name__ == "__main__":
    main()
