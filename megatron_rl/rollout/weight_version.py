"""The name of the policy weights an engine serves: "step-<n>", the RL step whose update produced them ("step-0":
the weights the run started from). Engines report it with every sample and SGLang keeps it as its
`weight_version`; this module is the one place that writes and reads it."""

from __future__ import annotations

import re

_NAME = re.compile(r"step-(\d+)$")


def weight_version(step: int) -> str:
    """The version name of the weights after RL step `step`."""
    return f"step-{step}"


def version_step(version: str, *, default: int | None = None) -> int:
    """The step of a version name ("step-12" -> 12); `default` for a name the trainer did not give (an engine's
    launch weights), else a ValueError naming the name."""
    match = _NAME.match(str(version))
    if match is not None:
        return int(match.group(1))
    if default is not None:
        return default
    raise ValueError(f"weight version {version!r} is not one of the trainer's ('step-<n>')")
