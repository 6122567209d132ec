"""Worker of bench_scaling.py (run under torchrun): time one actor training step on a fixed batch.

Prints one JSON line on rank 0: median seconds per step over --steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    for name in ("tp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    args = parser.parse_args()

    from megatron_rl.algorithms import policy_loss
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    layout = ParallelLayout(tp=args.tp, ep=args.ep)
    init_distributed(layout, seed=3)
    actor = MegatronActor.from_hf(args.model, layout, optimizer_options=OptimizerOptions(lr=1e-5),
                                  micro_batch_tokens=args.seq * 8)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    b, s = args.samples, args.seq
    batch = TokenBatch(torch.randint(4, 100, (b, s), generator=gen), torch.full((b,), s), torch.full((b,), s // 4))
    batch.fields["advantages"] = torch.randn(b, 1, generator=gen).expand(b, s).contiguous()
    batch.fields["old_log_probs"] = actor.compute_log_probs(batch).log_probs

    def loss_fn(logp, ent, mb):
        mask = mb.response_mask().to(logp.device).float()
        loss, _ = policy_loss("ppo", logp, mb.fields["old_log_probs"].to(logp.device),
                              mb.fields["advantages"].to(logp.device), mask)  # fmt: skip
        count = mask.sum().to(torch.int)
        return loss * count, count, {}

    actor.train_step(batch, loss_fn)  # warm-up
    times = []
    for _ in range(args.steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        actor.train_step(batch, loss_fn)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({"seconds": statistics.median(times), "tokens": b * s}), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
