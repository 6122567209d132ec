"""2-rank gloo run of the vocab-parallel top-k and log-prob-at-ids kernels (torchrun; test_topk_logprob.py).

Usage: python -m torch.distributed.run --nproc_per_node 2 topk_tp2.py INPUTS.pt OUT_DIR
Each rank takes its half of the vocabulary, computes the teacher's top-k and the student's log-probs at given ids
with the real TP group, back-propagates a weighted sum and saves outputs and its shard's gradient.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.kernels import next_token_logprobs_and_entropy
from megatron_rl.kernels.topk_logprob import next_token_logprobs_at, next_token_topk


def main(inputs_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    case = torch.load(inputs_path)
    shard = case["logits"].chunk(world, dim=-1)[rank].clone().requires_grad_()
    logp, _ = next_token_logprobs_and_entropy(
        shard, case["input_ids"], tp_group=group, valid_vocab_size=case["valid"], with_entropy=False
    )
    top_ids, top_logp = next_token_topk(
        shard.detach(), case["input_ids"], logp.detach(), case["k"], tp_group=group, valid_vocab_size=case["valid"]
    )
    at = next_token_logprobs_at(shard, case["input_ids"], logp, case["ids"], tp_group=group)
    (case["weights"] * at).sum().backward()
    out = {"top_ids": top_ids, "top_logp": top_logp, "at": at.detach(), "grad": shard.grad}
    torch.save(out, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
