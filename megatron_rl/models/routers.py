"""Router translations shared by families: DeepSeek-V3's sigmoid router with a score-correction bias and
group-limited top-k (also GLM-4.5's, `Glm4MoeTopkRouter`).

HF (transformers `DeepseekV3TopkRouter.forward`): scores = sigmoid(logits); the choice uses scores +
`e_score_correction_bias`; experts are grouped into `n_group` groups, each group scored by the sum of its two best
biased scores, the `topk_group` best groups kept, the top-k experts chosen among them; the gates are the UNBIASED
scores of the chosen experts, renormalised (`norm_topk_prob`) and multiplied by `routed_scaling_factor`.

Megatron (`moe_utils.topk_routing_with_score_function`, score_function="sigmoid" with an expert bias) computes the
same, with two differences the translation refuses rather than approximates:
- it renormalises the gates exactly when top-k > 1, so `norm_topk_prob=false` with top-k > 1 and
  `norm_topk_prob=true` with top-1 (transformers' single gate is then 1) are not expressible;
- its group score sums the top `topk // group_topk` scores of each group (`moe_utils.group_limited_topk`), HF's the
  top 2: equal only when `num_experts_per_tok // topk_group == 2` (DeepSeek-V3: 8 // 4).
Megatron also moves `expert_bias` during training (`moe_router_bias_update_rate`, its default 1e-3,
`finalize_model_grads._update_router_expert_bias`): the model builder sets the rate from
`model.options.expert_bias_update_rate` (default 0: an RL update must not change routing by itself).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.family import HFConfig, UnsupportedModelError

# config.json keys `sigmoid_router_kwargs` reads.
SIGMOID_ROUTER_KEYS = frozenset(
    {"n_routed_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "num_experts_per_tok"}
)


def grouped_top_k(hf: HFConfig) -> tuple[int, int] | None:
    """`(n_group, topk_group)` when the choice is group-limited, None when every expert can be chosen.

    Refuses a grouping Megatron computes differently from transformers (see the module docstring)."""
    experts, top_k = int(hf["n_routed_experts"]), int(hf["num_experts_per_tok"])
    groups, keep = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if groups <= 1 or keep >= groups:
        return None
    if experts % groups or experts // groups < 2:
        raise UnsupportedModelError(
            f"n_routed_experts={experts} does not split into n_group={groups} groups of at least 2 experts"
        )
    if top_k // keep != 2:
        raise UnsupportedModelError(
            f"group-limited routing with num_experts_per_tok={top_k} and topk_group={keep}: transformers scores a "
            f"group by its 2 best experts, Megatron by its num_experts_per_tok // topk_group = {top_k // keep} best; "
            "they choose different experts unless num_experts_per_tok // topk_group == 2"
        )
    return groups, keep


def sigmoid_router_kwargs(hf: HFConfig) -> dict[str, Any]:
    """Megatron `TransformerConfig` router kwargs of a DeepSeek-V3-style sigmoid router."""
    renormalise, top_k = bool(hf.get("norm_topk_prob", True)), int(hf["num_experts_per_tok"])
    if not renormalise and top_k > 1:
        raise UnsupportedModelError(
            "norm_topk_prob=false with a sigmoid router: Megatron's sigmoid routing always renormalises the chosen "
            "experts' gates when num_experts_per_tok > 1 (moe_utils.topk_routing_with_score_function), so the "
            "model would be computed differently; only norm_topk_prob=true is supported"
        )
    if renormalise and top_k == 1:
        raise UnsupportedModelError(
            "num_experts_per_tok=1 and norm_topk_prob=true with a sigmoid router: transformers sets the single "
            "gate to 1, Megatron's sigmoid routing keeps the sigmoid score for top-1"
        )
    kwargs: dict[str, Any] = dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_router_pre_softmax=False,
    )
    grouping = grouped_top_k(hf)
    if grouping is not None:
        kwargs.update(moe_router_num_groups=grouping[0], moe_router_group_topk=grouping[1])
    return kwargs
