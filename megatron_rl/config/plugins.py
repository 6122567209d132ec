"""The user's plugin modules: found next to the config file and in the working directory, imported before the
config is validated (`plugins: [module, ...]`); `rollout.plugin_check.check_plugins` then resolves every plugin a
config names before anything runs.

A plugin module registers rewards, environments or tools (`register_reward`, `register_env`, `register_tool`), or
is named by a dotted path (`data.reward: my_rewards:score`). Every rank under torchrun loads the config, so
every rank imports the same plugins.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from megatron_rl.config.errors import ConfigError


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
