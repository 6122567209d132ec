"""Run under torchrun (1 process): load two checkpoints' model weights and report whether they are bitwise equal."""

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoint
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout, seed=0)
    weights = []
    for path in (args.a, args.b):
        actor = MegatronActor.from_hf(args.model, layout)
        checkpoint.load_checkpoint(actor, path, load_optimizer=False)
        weights.append({k: v.clone() for k, v in actor.modules[0].state_dict().items() if torch.is_tensor(v)})
    hf = MegatronActor.from_hf(args.model, layout).modules[0].state_dict()
    equal = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    moved = any(not torch.equal(weights[0][k], hf[k]) for k in weights[0] if torch.is_tensor(hf.get(k)))
    json.dump({"equal": equal, "moved_from_initial": moved}, open(args.out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
