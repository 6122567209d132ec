"""What the critic (`algo.advantage: gae`) costs per GPU, for the launch planner's memory estimate.

The value model (`megatron_backend/critic`) is a second model of the policy's architecture in the actor's layout
(`algo.critic.hf_path` is priced as the policy's architecture), trained as the actor is: weights in the model
dtype, fp32 gradients, its own optimizer state by the same rules (sharded over data-parallel ranks by the
distributed optimizer, in host memory with `optimizer.cpu_offload`). Its parameters are the actor's with the
vocabulary projection replaced by a value head (hidden values, whole on every TP rank of the last pipeline stage)
and an input embedding of its own (never tied to the head). Its activations are not added: its forward and
backward passes run between the actor's, never beside them, and hold no vocabulary-wide logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.algorithms.gae import ADVANTAGE as GAE
from megatron_rl.launch.model_memory import HOST_BYTES_PER_PARAM, layer_params, optimizer_bytes_per_param, stage_ranges
from megatron_rl.models.family import ModelDims


@dataclass(frozen=True)
class CriticMemory:
    """The critic's share of a GPU of the most loaded pipeline stage."""

    params: float  # its parameters on this GPU
    device: float  # weights + gradients + the optimizer state left on the GPU (bytes)
    host_optimizer: float  # optimizer.cpu_offload: the optimizer state this GPU keeps in host memory (bytes)
    offloaded: float  # the parameters whose state is offloaded (their updates cross PCIe)


def critic_params(d: ModelDims, shared_gate: bool, layout) -> tuple[float, float]:
    """`(dense, experts)`: the critic's parameters on a GPU of its most loaded pipeline stage, outside and inside
    the routed experts (the first stage adds the embedding, the last the final norm and the value head)."""
    tp, ep, etp = (layout.tp, layout.ep, layout.etp) if layout else (1, 1, 1)
    dense, experts = layer_params(d, shared_gate)
    stages = stage_ranges(d, layout)
    h, last = d.hidden_size, len(stages) - 1
    loads = [
        (
            sum(dense[i] for i in stage) / tp + (d.vocab_size * h / tp if s == 0 else 0) + (2 * h if s == last else 0),
            sum(experts[i] for i in stage) / (ep * etp),
        )
        for s, stage in enumerate(stages)
    ]
    return max(loads, key=sum)


def critic_memory(cfg, d: ModelDims, shared_gate: bool, layout) -> CriticMemory | None:
    """The critic's bytes per GPU under `cfg` (RLConfig); None without a critic."""
    if cfg.algo.advantage != GAE:
        return None
    dense, experts = critic_params(d, shared_gate, layout)
    dp, edp = (layout.dp, layout.expert_dp) if layout else (1, 1)
    opt, bf16 = cfg.optimizer, cfg.model.options.dtype == "bf16"
    shard = dense / dp + experts / edp if opt.distributed_optimizer else dense + experts
    offloaded = shard * opt.offload_fraction if opt.cpu_offload else 0.0
    weights_and_grads = (dense + experts) * ((2 if bf16 else 4) + 4)
    device = weights_and_grads + (shard - offloaded) * optimizer_bytes_per_param(opt, bf16)
    return CriticMemory(dense + experts, device, offloaded * HOST_BYTES_PER_PARAM, offloaded)
