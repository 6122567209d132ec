"""2-rank gloo check of `token_logprobs_and_entropy` under a real TP group, run by torchrun.

Usage: python -m torch.distributed.run --nproc_per_node 2 vocab_parallel_tp2.py INPUTS.pt OUT_DIR

INPUTS.pt holds a list of cases (full-vocab logits, targets, loss weights, input dtype, options). Each rank
takes its contiguous half of the vocabulary, computes log-probs and entropy, backpropagates the same weighted
loss as every other rank (Megatron's TP convention) and saves its outputs and its shard's gradient to
OUT_DIR/rank{R}.pt, which the test compares with the single-process full-vocabulary reference. For the cases
without vocabulary padding it also records megatron's `vocab_parallel_cross_entropy` on the same shards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.kernels.reference_logprob import token_logprobs_and_entropy


def _init_megatron_tp2() -> dist.ProcessGroup:
    """Initialise megatron's parallel state with TP=2 on CPU and return its tensor-parallel group."""
    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return parallel_state.get_tensor_model_parallel_group()


def main(inputs_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tp_group = _init_megatron_tp2()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    cases, results = torch.load(inputs_path), []
    for case in cases:
        shard = case["logits"].chunk(tp, dim=-1)[rank].to(case["dtype"], copy=True).requires_grad_()
        logprobs, entropy = token_logprobs_and_entropy(
            shard,
            case["targets"],
            tp_group=tp_group,
            valid_vocab_size=case["valid_vocab_size"],
            temperature=case["temperature"],
        )
        loss = (case["w_logprobs"] * logprobs + case["w_entropy"] * entropy).sum()
        loss.backward()
        result = {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grad": shard.grad}
        if case["valid_vocab_size"] is None:
            # megatron subtracts the max from its fp32 input in place, so hand it a fresh tensor.
            scaled = (shard.detach().float() / case["temperature"]).requires_grad_()
            megatron_logprobs = -vocab_parallel_cross_entropy(scaled, case["targets"])
            megatron_logprobs.sum().backward()
            result["megatron_logprobs"] = megatron_logprobs.detach()
            result["megatron_grad"] = scaled.grad
        results.append(result)
    # vocab_start_index is derived from the rank; an explicit value that contradicts it is an error.
    shard, targets = cases[0]["logits"].chunk(tp, dim=-1)[rank], cases[0]["targets"]
    try:
        token_logprobs_and_entropy(shard, targets, tp_group=tp_group, vocab_start_index=(1 - rank) * shard.shape[-1])
        rejected = False
    except ValueError:
        rejected = True
    out = {"cases": results, "rejected_contradicting_vocab_start_index": rejected}
    torch.save(out, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
