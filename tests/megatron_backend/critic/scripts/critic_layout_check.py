"""The critic's numbers in one layout (`critic_numbers`), and, run under torchrun on 2 ranks, in each of `LAYOUTS`
one after another in this one job (rank 0 writes them as JSON to argv[2], keyed by layout name).

`critic_numbers` loads the checkpoint into a `MegatronCritic`, computes the values of a fixed batch, takes two
updates with the trainer's clipped value loss (fixed returns; old values = the values before the first update, so
the first update clips nothing and the second, whose values have moved, clips some tokens) and computes the values
again. The test runs it in one process (TP=1) for the reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.models.architecture import model_dims
from megatron_rl.parallel_layout import ParallelLayout, ResolvedLayout
from tests.megatron_backend.actor.scripts.actor_layout_check import layout_batch

LAYOUTS = {
    "tp2_sp": ParallelLayout(tp=2),  # sequence parallelism: on by default with TP > 1 (and required with MoE)
    "ep2": ParallelLayout(ep=2),
    "pp2": ParallelLayout(pp=2),
    "dp2": ParallelLayout(),  # the distributed optimizer shards over both ranks
}
VALUE_CLIP = 0.02  # the first update moves the values by a few hundredths: about half the tokens clip in the second


def fixed_batch() -> tuple[TokenBatch, torch.Tensor]:
    """The actor's layout-check batch and returns drawn once (0 outside the responses)."""
    batch = layout_batch()
    returns = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(4))
    return batch, torch.where(batch.response_mask(), returns, 0.0)


def critic_numbers(model_dir: Path, layout: ParallelLayout, resolved: ResolvedLayout) -> dict:
    """Values before and after two clipped-value-loss updates, each update's loss, grad norm and clip fraction (the
    same on every rank), and the parameters of the most loaded rank with the launch planner's count of them."""
    from megatron_rl.config.options import ModelOptions, OptimizerOptions
    from megatron_rl.launch.critic_memory import critic_params
    from megatron_rl.launch.model_memory import shared_expert_gate
    from megatron_rl.megatron_backend.critic.value_model import MegatronCritic
    from megatron_rl.trainer.step.critic_phase import build_value_loss

    critic = MegatronCritic.from_hf(
        model_dir, layout, model_options=ModelOptions(dispatcher="alltoall"), micro_batch_tokens=64,
        optimizer_options=OptimizerOptions(lr=1e-4, clip_grad=1.0, distributed_optimizer=True),
    )  # fmt: skip
    batch, returns = fixed_batch()
    values = critic.compute_values(batch)
    batch.fields.update(loss_mask=batch.response_mask().float(), old_values=values, returns=returns)
    loss_fn = build_value_loss(VALUE_CLIP)
    steps = [critic.train_step(batch, loss_fn) for _ in range(2)]
    here = torch.tensor(float(sum(p.numel() for chunk in critic.chunks for p in chunk.parameters())))
    torch.distributed.all_reduce(here, op=torch.distributed.ReduceOp.MAX)
    dims = model_dims(critic.source_config)
    return {
        "params": int(here),  # the most loaded rank's
        "planned": sum(critic_params(dims, shared_expert_gate(critic.source_config, dims), resolved)),
        "values": values.tolist(),
        "steps": [{k: s[k] for k in ("loss", "grad_norm", "clip_frac", "count")} for s in steps],
        "values_after": critic.compute_values(batch).tolist(),
    }


def main(model_dir: str, out: str) -> None:
    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    torch._dynamo.config.disable = True  # Megatron's jit_fuser: compile time for nothing at these sizes
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown

    results = {}
    for name, layout in LAYOUTS.items():
        resolved = init_distributed(layout, seed=7)
        results[name] = critic_numbers(Path(model_dir), layout, resolved)
        ParallelLayout.destroy()
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
