"""Pure-torch RL math: policy losses, loss aggregation, advantages, KL penalties, rollout correction, DAPO shaping.

Nothing here imports Megatron, SGLang or Transformer Engine. Tensors are ``[batch, response_len]`` with a 0/1
response mask; see ``docs/algorithms.md`` for how each published algorithm maps onto these functions.
"""

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from megatron_rl.algorithms.aggregation import AGGREGATIONS, aggregate
from megatron_rl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from megatron_rl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossConfig, TokenLoss, policy_loss
from megatron_rl.algorithms.reward_shaping import filter_groups, overlong_filter_mask, overlong_penalty
from megatron_rl.algorithms.rollout_correction import correction_stats, rollout_correction_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "TokenLoss",
    "aggregate",
    "compute_advantages",
    "filter_groups",
    "kl_penalty",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
    "correction_stats",
    "rollout_correction_weights",
]
