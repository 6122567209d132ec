"""2-rank gloo run of the chunked and Triton log-prob kernels (torchrun; see tests/kernels/test_logprob.py).

Usage: python -m torch.distributed.run --nproc_per_node 2 logprob_tp2.py INPUTS.pt OUT_DIR
Each rank takes its contiguous half of the vocabulary, runs every implementation listed in INPUTS.pt with the
real TP group (one all-gather), backpropagates the same weighted loss and saves outputs and shard gradient.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.kernels import token_logprobs_and_entropy


def main(inputs_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spec = torch.load(inputs_path)
    out = {}
    for impl in spec["impls"]:
        results = []
        for case in spec["cases"]:
            shard = case["logits"].chunk(world, dim=-1)[rank].to(case["dtype"], copy=True).requires_grad_()
            logprobs, entropy = token_logprobs_and_entropy(
                shard, case["targets"], tp_group=group, valid_vocab_size=case["valid_vocab_size"],
                temperature=case["temperature"], impl=impl,
            )  # fmt: skip
            (case["w_logprobs"] * logprobs + case["w_entropy"] * entropy).sum().backward()
            results.append({"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grad": shard.grad})
        out[impl] = results
    torch.save(out, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
