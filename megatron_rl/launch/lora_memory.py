"""What LoRA adapters (`model.lora`) cost per GPU, for the launch planner's memory estimate.

Priced as `megatron_backend/lora/adapters.py` builds them: per adapted linear layer an A (r x in) and a B (out x r),
one per HF projection a fused layer holds (QKV: q, k, v; a dense or shared-expert fc1: gate, up; a routed expert's
fc1: one A, one B over gate and up; with `share_expert_a` one A per MoE layer for fc1 and one for fc2, a replica on
every expert-parallel rank). Column-parallel layers split B over TP (A replicated), row-parallel ones split A (B
replicated); routed experts' adapters live on their expert-parallel rank. Multi-Latent Attention is priced as
r x (in + out) on each of its linear layers. Pure arithmetic on `ModelDims`.
"""

from __future__ import annotations

from megatron_rl.config.options import LoRAOptions
from megatron_rl.launch.model_memory import stage_ranges
from megatron_rl.models.family import ModelDims


def _attention(d: ModelDims, r: int, tp: int) -> float:
    h, hd, heads, groups = d.hidden_size, d.head_dim, d.num_attention_heads, d.num_query_groups
    if d.kv_lora_rank:  # every linear layer of MLA: r x (in + out), split over TP
        nope, v, rank = hd - d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
        query = [(h, d.q_lora_rank), (d.q_lora_rank, heads * hd)] if d.q_lora_rank else [(h, heads * hd)]
        layers = query + [(h, rank + d.qk_rope_head_dim), (rank, heads * (nope + v)), (heads * v, h)]
        return sum(r * (i + o) for i, o in layers) / tp
    qkv = 3 * r * h + r * (heads + 2 * groups) * hd / tp  # column-parallel: q, k, v A's whole, B's split
    return qkv + r * heads * hd / tp + r * h  # output, row-parallel: A split, B whole


def _gated_mlp(h: int, ffn: int, r: int, tp: int) -> float:
    """A dense (or shared-expert) MLP: fc1's gate and up adapters (column-parallel), fc2's (row-parallel)."""
    return 2 * (r * h + r * ffn / tp) + r * ffn / tp + r * h


def lora_params(d: ModelDims, lora: LoRAOptions, layout) -> tuple[float, float]:
    """`(dense, experts)`: the adapter parameters a GPU of the most loaded pipeline stage holds outside and inside the
    routed experts (the optimizer shards the first over dp, the second over expert-dp)."""
    tp, ep = (layout.tp, layout.ep) if layout else (1, 1)
    h, r, targets = d.hidden_size, lora.rank, lora.targets
    attention = _attention(d, r, tp) if "attention" in targets else 0.0
    mlp = _gated_mlp(h, d.ffn_hidden_size, r, tp) if "mlp" in targets else 0.0
    ffn = d.shared_expert_ffn_hidden_size
    shared = _gated_mlp(h, ffn, r, tp) if ffn and "shared_experts" in targets else 0.0
    moe = d.moe_ffn_hidden_size
    a, b = (r * h + r * moe, r * 2 * moe + r * h) if "experts" in targets else (0.0, 0.0)  # fc1: one A, B gate + up
    local = d.num_experts / ep
    expert = a + b * local if lora.share_expert_a else (a + b) * local  # a shared A: one replica per EP rank
    dense = [attention + (shared if m else mlp) for m in d.moe_layer_pattern]
    experts = [expert if m else 0.0 for m in d.moe_layer_pattern]
    stages = stage_ranges(d, layout)
    return max(sum(dense[i] for i in s) for s in stages), max(sum(experts[i] for i in s) for s in stages)
