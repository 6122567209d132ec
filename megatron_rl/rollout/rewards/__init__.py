"""Rewards: built-ins people use, reward functions as users write them, weighted sums, and scoring with enforced
timeouts and a failure limit.

`data.reward` is a registered name (`megatron-rl rewards` lists them), an import path "package.module:function",
or a list of `{name, weight, options}`: `sample.reward = sum(weight * value)`, each value kept in
`sample.reward_parts[name]` and logged as `reward/<name>_mean`; `options` are keyword arguments of every call.

Two signatures are accepted, told apart by `inspect.signature` (`user_functions`):

- ``fn(sample, text, metadata, **options) -> float``, per sample: `text` is the decoded response (special tokens
  skipped, so the stop token is not in it), `metadata` the sample's: the reference "answer", the templated
  "prompt" and the row's other columns (`data_source`, ...).
- TRL's batched ``fn(prompts, completions, **kwargs) -> list[float]`` (GRPOTrainer's `reward_funcs`): lists of
  prompts and completions (strings; for chat data, message lists), `completion_ids` and every other column as a
  keyword list.

A call that raises, runs past `data.reward_timeout_s` or returns a non-number (None, a string, NaN) scores 0; more
than `data.reward_failure_limit` of them in one batch stop the run with `RewardFailureError` (`scoring`).

`remote` scores with a reward service over HTTP, batched; its JSON contract and time limits are in `remote`.
"""

from megatron_rl.rollout.rewards.math_rewards import (
    AUTO_ROUTES,
    answers_match,
    auto,
    check_auto_sources,
    dapo,
    extract_final_answer,
    gsm8k,
    math_answer,
    math_reward,
)
from megatron_rl.rollout.rewards.registry import REWARD_FUNCTIONS, RewardFn, exact_match, get_reward, register_reward
from megatron_rl.rollout.rewards.scoring import (
    RewardFailureError,
    RewardSet,
    RewardStats,
    build_reward,
    check_data_sources,
    compute_rewards,
)

__all__ = [
    "AUTO_ROUTES",
    "REWARD_FUNCTIONS",
    "RewardFailureError",
    "RewardFn",
    "RewardSet",
    "RewardStats",
    "answers_match",
    "auto",
    "build_reward",
    "check_auto_sources",
    "check_data_sources",
    "compute_rewards",
    "dapo",
    "exact_match",
    "extract_final_answer",
    "get_reward",
    "gsm8k",
    "math_answer",
    "math_reward",
    "register_reward",
]
