"""The user's plugin modules: found next to the config file and in the working directory, imported before the
config is validated (`plugins: [module, ...]`), and every plugin a config names resolved before anything runs.

A plugin module registers rewards, environments or tools (`register_reward`, `register_env`, `register_tool`), or
is named by a dotted path (`data.reward: my_rewards:score`). Every rank under torchrun loads the config, so
every rank imports the same plugins.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import RLConfig


def plugin_folders(config_path: str | Path | None) -> list[Path]:
    """Where plugin modules are found besides sys.path: the config file's folder, then the working directory."""
    folders = [Path(config_path).absolute().parent] if config_path is not None else []
    return [*folders, Path(os.getcwd())]


def add_plugin_folders(config_path: str | Path | None) -> None:
    """Make modules next to the config file and in the working directory importable (appended to sys.path, so a
    plugin never shadows an installed package)."""
    for folder in plugin_folders(config_path):
        if str(folder) not in sys.path:
            sys.path.append(str(folder))


def import_plugins(modules: Iterable[str], config_path: str | Path | None = None) -> None:
    """Import each of `modules` (the `plugins` key); a ConfigError names one that does not import and where it was
    looked for."""
    add_plugin_folders(config_path)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            where = ", ".join(str(f) for f in plugin_folders(config_path))
            raise ConfigError(
                f"plugins: cannot import {name!r} ({err}); searched {where} and PYTHONPATH: put the module next to "
                "the config file or in the working directory, or add its folder to PYTHONPATH"
            ) from err


def check_plugins(cfg: RLConfig) -> None:
    """Resolve every plugin `cfg` names (the rewards of `data.reward`, `rollout.env` with the tools and tool-call
    format in `rollout.env_options`, `rollout.generate_fn`): one ConfigError listing each that does not resolve. Run
    before anything is built or planned; plugin modules must be imported (`import_plugins`) first."""
    from megatron_rl.rollout.agent.env import get_env, get_generate_fn
    from megatron_rl.rollout.agent.tool_calls import TOOL_CALL_FORMATS
    from megatron_rl.rollout.agent.tools import TOOLS
    from megatron_rl.rollout.plugins import lookup
    from megatron_rl.rollout.rewards import get_reward

    errors: list[str] = []

    def resolve(key: str, resolver: Callable[[], object]) -> None:
        try:
            resolver()
        except ValueError as err:
            errors.append(f"{key}: {err}")

    for spec in cfg.data.reward_specs():
        resolve(f"data.reward={spec.name!r}", functools.partial(get_reward, spec.name))
    env, generate_fn = cfg.rollout.env, cfg.rollout.generate_fn
    if env is not None:
        resolve(f"rollout.env={env!r}", functools.partial(get_env, env))
        tools = (cfg.rollout.env_options or {}).get("tools") or ()
        for tool in [tools] if isinstance(tools, str) else tools:
            resolve(f"rollout.env_options.tools: {tool!r}", functools.partial(lookup, tool, TOOLS, "tool"))
        call_format = (cfg.rollout.env_options or {}).get("tool_call_format")
        if isinstance(call_format, str):
            key = f"rollout.env_options.tool_call_format={call_format!r}"
            resolve(key, functools.partial(lookup, call_format, TOOL_CALL_FORMATS, "tool-call format"))
    if generate_fn is not None:
        resolve(f"rollout.generate_fn={generate_fn!r}", functools.partial(get_generate_fn, generate_fn))
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError("plugins that do not resolve:\n  - " + "\n  - ".join(errors))
