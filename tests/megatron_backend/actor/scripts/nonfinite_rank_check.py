"""Run under torchrun (2 ranks, DP=2): a NaN gradient on rank 1 only, every loss finite. Writes per rank the
stop message, the skipped count, whether the weights stayed as they were and the actor's step."""

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron_rl.megatron_backend.actor.update_metrics import NonFiniteError
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout
    from tests.megatron_backend.actor.test_update_nonfinite import _actor, _weights, batch, nan_gradient_loss, pg_loss

    init_distributed(ParallelLayout(), seed=11)
    rank = dist.get_rank()
    actor = _actor(args.model)
    actor.train_step(batch(), pg_loss)
    weights = _weights(actor)
    loss = nan_gradient_loss if rank == 1 else pg_loss
    try:
        actor.train_step(batch(), loss, where="update 2")
        stop = ""
    except NonFiniteError as err:
        stop = str(err)
    skipped = actor.train_step(batch(), loss, on_nonfinite="skip")["nonfinite_skipped"]
    kept = all(torch.equal(a, b) for a, b in zip(_weights(actor), weights, strict=True))
    result = {"stop": stop, "skipped": skipped, "weights_kept": kept, "step": actor.step}
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({str(i): r for i, r in enumerate(gathered)}, f)
    shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
