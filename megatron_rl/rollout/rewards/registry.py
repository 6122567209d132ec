"""The registry of reward names, loading rewards by dotted path, and the cheap built-ins.

`register_reward(name, inline=True)` marks a reward that cannot hang (pure string checks, or `remote`, whose every
request has its own timeout and bounded retries): it is scored in the calling thread, with no worker process and no
`data.reward_timeout_s`. Every other reward runs in a killable worker process.

A reward may expose `fn.extract_answer(text) -> str | None`, its final answer in a canonical form (the key maj@k
votes on; None: no answer); `RewardSet.extract_answer` documents the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megatron_rl.rollout.plugins import lookup_callable, register_in
from megatron_rl.rollout.sample import Sample

RewardFn = Callable[[Sample, str, Mapping[str, Any]], float]
# name -> the function, or its dotted path (loaded on first use: the synthetic tasks import the engine stack)
REWARD_FUNCTIONS: dict[str, Any] = {}
INLINE_REWARDS: set[str] = set()  # names scored in the calling thread (cannot hang)
REQUIRED_MODULES: dict[str, str] = {}  # name -> optional module it needs, checked when a run starts


def register_reward(name: str, *, inline: bool = False, requires: str | None = None) -> Callable[[Any], Any]:
    """Decorator: make `fn` available as `get_reward(name)`. `inline`: it cannot hang, score it in the calling thread;
    `requires`: an optional module it imports (a missing one is named when the run starts)."""
    add = register_in(REWARD_FUNCTIONS, "reward", name)

    def register(fn: Any) -> Any:
        add(fn)
        if inline:
            INLINE_REWARDS.add(name)
        if requires:
            REQUIRED_MODULES[name] = requires
        return fn

    return register


def get_reward(name: str | Callable[..., Any]) -> Callable[..., Any]:
    """A registered name, a dotted path ("package.module:function" or "package.module.function"), or a callable."""
    return lookup_callable(name, REWARD_FUNCTIONS, "reward", "a function")


@register_reward("exact_match", inline=True)
def exact_match(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the stripped response equals the stripped reference answer."""
    return float(text.strip() == str(metadata["answer"]).strip())


def stripped_answer(text: str) -> str | None:
    """exact_match's answer for maj@k: the stripped response; None when it is empty."""
    return text.strip() or None


exact_match.extract_answer = stripped_answer


register_reward("synthetic", inline=True)("megatron_rl.rollout.tasks.synthetic_task:synthetic_reward")
register_reward("synthetic_tool", inline=True)("megatron_rl.rollout.tasks.synthetic_tool_task:tool_task_reward")
register_reward("remote", inline=True)("megatron_rl.rollout.rewards.remote:remote")
register_reward("judge", inline=True)("megatron_rl.rollout.rewards.judge:judge")
