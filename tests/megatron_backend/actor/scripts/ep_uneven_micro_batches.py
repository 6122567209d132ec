"""Run under torchrun: EP=2 with DP=2 where the ranks' samples need different numbers of micro-batches.

Expert-parallel all-to-alls span the data-parallel ranks, so the actor must give every rank the same number
of micro-batches; without that this deadlocks. Prints RESULT <json> on rank 0.
"""

import json
import sys

import torch

from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
from megatron_rl.parallel_layout import ParallelLayout


def main() -> None:
    model, ep, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    layout = ParallelLayout(ep=ep)
    init_distributed(layout, seed=1)
    actor = MegatronActor.from_hf(model, layout, optimizer_options=OptimizerOptions(lr=1e-3), micro_batch_tokens=40)
    # Rows 0, 2, 4 (DP rank 0) are long, rows 1, 3 (DP rank 1) short: 3 micro-batches against 1.
    lengths = torch.tensor([20, 5, 20, 5, 20])
    ids = torch.randint(4, 100, (5, 20), generator=torch.Generator().manual_seed(0))
    batch = TokenBatch(ids, lengths, torch.tensor([3, 2, 3, 2, 3]))
    scored = actor.compute_log_probs(batch, route_mode="record")

    def loss_fn(logp, ent, mb):
        mask = mb.response_mask().float()
        return -(logp * mask).sum(), mask.sum().to(torch.int), {}

    metrics = actor.train_step(batch, loss_fn)
    if torch.distributed.get_rank() == 0:
        result = {"log_probs": scored.log_probs.tolist(), "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        json.dump(result, open(out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
