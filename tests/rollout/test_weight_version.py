"""The weight version name: the trainer writes "step-<n>" and reads the step back, refusing other names."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.weight_version import version_step, weight_version


def test_the_name_round_trips_and_other_names_are_refused_or_defaulted() -> None:
    assert weight_version(12) == "step-12" and version_step(weight_version(12)) == 12
    assert version_step("step-0") == 0
    assert version_step("default", default=-1) == -1  # an engine's launch weights
    for name in ("default", "step-", "step-3a", "12", "xstep-3"):
        with pytest.raises(ValueError, match="is not one of the trainer's"):
            version_step(name)
