"""Run under torchrun: `decided_on_rank0` hands every rank rank 0's value, and rank 0's ValueError. Each rank writes
what it got, and which of its own functions ran, to `--out/rank<r>.json`."""

import argparse
import json
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    from megatron_rl.megatron_backend.distributed import decided_on_rank0

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, ran = dist.get_rank(), []

    def decide() -> dict:
        ran.append("decide")
        return {"start_step": 7, "decided_by": rank}

    def refuse() -> None:
        ran.append("refuse")
        raise ValueError(f"rank {rank}: output_dir holds another run; set trainer.overwrite=true")

    value = decided_on_rank0(decide)
    try:
        decided_on_rank0(refuse)
        error = None
    except ValueError as err:
        error = str(err)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"value": value, "error": error, "ran": ran}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
