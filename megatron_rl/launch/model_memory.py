"""A trained model's parameters per GPU and its optimizer's bytes per parameter, for the launch planner.

Counted as Megatron-Core builds the model: per layer attention (or Multi-Latent Attention) with its norms, then a
dense MLP, or an MoE layer's router, shared expert (and its gate) and routed experts; the embedding and the output
layer. Dense parameters split over TP, routed experts over EP x expert TP, layers over the pipeline stages. Pure
arithmetic on `ModelDims`.
"""

from __future__ import annotations

import itertools
import math

from megatron_rl.models.family import ModelDims, get_family

STATE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
HOST_BYTES_PER_PARAM = 16
"""Host memory per offloaded parameter: Megatron's HybridDeviceOptimizer keeps an fp32 copy of each shard
(`param_update_in_fp32`), torch AdamW's fp32 exp_avg and exp_avg_sq, and a pinned fp32 gradient buffer."""
PCIE_BYTES_PER_PARAM = 8
"""PCIe bytes per offloaded parameter and update: the fp32 gradient down, the fp32 updated copy up (copied into
the bf16 parameter on the GPU)."""


def stage_ranges(d: ModelDims, layout) -> list[range]:
    """The global layer indices of each pipeline stage (`layout.stage_layers`, else an even split)."""
    pp = layout.pp if layout else 1
    sizes = list(layout.stage_layers) if layout and layout.stage_layers else [math.ceil(d.num_layers / pp)] * pp
    ends = itertools.accumulate(sizes)
    return [range(min(end - n, d.num_layers), min(end, d.num_layers)) for n, end in zip(sizes, ends, strict=True)]


def attention_params(d: ModelDims) -> int:
    """One layer's attention parameters and its two layer norms.

    Multi-Latent Attention (`kv_lora_rank` > 0; transformers `DeepseekV3Attention`): the query latent
    (h x q_lora_rank, its norm, q_lora_rank x heads x q_head) or one query projection (h x heads x q_head), the KV
    latent with the shared rotary key (h x (kv_lora_rank + rope)), its norm, its expansion to each head's key
    and value (kv_lora_rank x heads x (nope + v)) and the output (heads x v x h)."""
    h, hd, heads, groups = d.hidden_size, d.head_dim, d.num_attention_heads, d.num_query_groups
    if d.kv_lora_rank:
        nope, v, rank = hd - d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
        query = d.q_lora_rank * (h + 1 + heads * hd) if d.q_lora_rank else h * heads * hd
        latent = h * (rank + d.qk_rope_head_dim) + rank + rank * heads * (nope + v)
        return query + latent + heads * v * h + 2 * h
    attention = h * heads * hd * 2 + 2 * h * groups * hd + 2 * h  # q and output, k and v, the two layer norms
    return attention + (2 * hd if d.qk_layernorm else 0) + ((heads + 2 * groups) * hd if d.qkv_bias else 0)


def shared_expert_gate(hf: dict, d: ModelDims) -> bool:
    """Whether the shared expert's output is scaled by a learned gate (Qwen2-MoE; not DeepSeek-V3 or GLM-4.5), as
    the family's weight mappings say."""
    if not d.shared_expert_ffn_hidden_size or not d.moe_layers:
        return False
    gate = f"decoder.layers.{d.moe_layers[0]}.mlp.shared_experts.gate_weight"
    return get_family(hf).weight_map(hf).rule(gate) is not None


def layer_params(d: ModelDims, shared_gate: bool) -> tuple[list[int], list[int]]:
    """Each layer's parameters outside and inside the routed experts."""
    h = d.hidden_size
    attention = attention_params(d)
    shared = d.shared_expert_ffn_hidden_size
    # the router, the shared expert and its gate
    moe_dense = d.num_experts * h + (3 * h * shared if shared else 0) + (h if shared_gate else 0)
    expert = d.num_experts * 3 * h * d.moe_ffn_hidden_size
    dense = [attention + (moe_dense if m else 3 * h * d.ffn_hidden_size) for m in d.moe_layer_pattern]
    return dense, [expert if m else 0 for m in d.moe_layer_pattern]


def weight_shard(d: ModelDims, shared_gate: bool, layout) -> tuple[float, float, dict]:
    """`(dense, experts, params)`: the parameters a GPU of the most loaded pipeline stage holds outside and inside
    the experts, and the model's total / expert / active parameter counts."""
    h = d.hidden_size
    per_layer_dense, per_layer_expert = layer_params(d, shared_gate)
    embed = d.vocab_size * h
    head = 0 if d.tie_word_embeddings else embed
    total_params = sum(per_layer_dense) + sum(per_layer_expert) + embed + head + h
    active = total_params - sum(per_layer_expert) + sum(per_layer_expert) * d.top_k / max(d.num_experts, 1)
    params = {"total": total_params, "experts": sum(per_layer_expert), "active": active}

    tp, pp, ep, etp = (layout.tp, layout.pp, layout.ep, layout.etp) if layout else (1, 1, 1, 1)
    # The heaviest stage's own layers (a dense first layer, GLM-4.5's 10944-wide MLP, is not every layer's).
    stages = stage_ranges(d, layout)
    dense_layers = max(sum(per_layer_dense[i] for i in stage) for stage in stages)
    expert_layers = max(sum(per_layer_expert[i] for i in stage) for stage in stages)
    dense = dense_layers / tp + max(embed, head) / tp * (1 if pp > 1 else 2 - d.tie_word_embeddings)
    return dense, expert_layers / (ep * etp), params


def optimizer_bytes_per_param(opt, bf16: bool) -> float:
    """GPU bytes of optimizer state per parameter it holds: main copy + Adam's two moments.

    Resident optimizer: an fp32 main copy of bf16 weights (fp32 weights are their own) and fp32 moments: 12 / 8 B.
    Precision-aware (Transformer Engine's FusedAdam, bf16 weights): the moments in `moments_dtype` (fp8 = 1 B) and
    the main copy in `main_params_dtype`, where fp32 is stored as the 16 bits a bf16 weight lacks
    (`store_param_remainders`, Megatron's default with TE >= 2.1): 2 B either way. With CPU offload the share left
    on the GPU is the hybrid optimizer's fp32 copy and fp32 moments: 12 B."""
    if opt.cpu_offload:
        return 12
    if opt.precision_aware:
        return 2 + 2 * STATE_BYTES[opt.moments_dtype]
    return (4 if bf16 else 0) + 8
