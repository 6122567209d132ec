"""Every plugin a config names, resolved before anything is built: rewards, environments, tools, tool-call formats
and custom generate functions (plugin modules are imported first: `config.loader.import_plugins`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import DataConfig, RolloutConfig
from megatron_rl.rollout.plugins import lookup


def check_plugins(data: DataConfig, rollout: RolloutConfig) -> None:
    """Resolve every plugin the config's `data` and `rollout` sections name (the rewards of `data.reward`, with
    their signatures and options, `rollout.env` with the tools and tool-call format in `rollout.env_options`,
    `rollout.generate_fn`): one ConfigError listing each that does not resolve. Run before anything is built or
    planned; plugin modules must be imported (`import_plugins`) first."""
    from megatron_rl.rollout.agent.env import get_env, get_generate_fn
    from megatron_rl.rollout.agent.tool_calls import TOOL_CALL_FORMATS
    from megatron_rl.rollout.agent.tools import TOOLS
    from megatron_rl.rollout.rewards import get_reward
    from megatron_rl.rollout.rewards.user_functions import check_options, reward_style

    errors: list[str] = []

    def resolve(key: str, resolver: Callable[[], object]) -> None:
        try:
            resolver()
        except ValueError as err:
            errors.append(f"{key}: {err}")

    def check_reward(name: str, options: dict) -> None:
        fn = get_reward(name)
        check_options(fn, reward_style(fn, name), options, name)  # e.g. remote's url, refused here in one line

    for spec in data.reward_specs():
        resolve(f"data.reward={spec.name!r}", functools.partial(check_reward, spec.name, spec.options))
    env, generate_fn = rollout.env, rollout.generate_fn
    if env is not None:
        resolve(f"rollout.env={env!r}", functools.partial(get_env, env))
        tools = (rollout.env_options or {}).get("tools") or ()
        for tool in [tools] if isinstance(tools, str) else tools:
            resolve(f"rollout.env_options.tools: {tool!r}", functools.partial(lookup, tool, TOOLS, "tool"))
        call_format = (rollout.env_options or {}).get("tool_call_format")
        if isinstance(call_format, str):
            key = f"rollout.env_options.tool_call_format={call_format!r}"
            resolve(key, functools.partial(lookup, call_format, TOOL_CALL_FORMATS, "tool-call format"))
    if generate_fn is not None:
        resolve(f"rollout.generate_fn={generate_fn!r}", functools.partial(get_generate_fn, generate_fn))
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError("plugins that do not resolve:\n  - " + "\n  - ".join(errors))
