"""`megatron-rl rewards`: every registered reward with its one-line summary, and the signatures accepted."""

from __future__ import annotations

import subprocess
import sys

from megatron_rl.commands.rewards import summary
from megatron_rl.rollout.rewards import REWARD_FUNCTIONS, get_reward

CLI = [sys.executable, "-m", "megatron_rl.cli", "rewards"]


def test_rewards_lists_every_registered_reward_and_both_signatures() -> None:
    proc = subprocess.run(CLI, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in REWARD_FUNCTIONS:
        row = next((line for line in lines if line.startswith(name + " ")), None)
        assert row is not None, f"{name} missing from `megatron-rl rewards`"
        assert summary(get_reward(name)) in row or name == "math_verify"
    assert next(line for line in lines if line.startswith("math_verify ")).endswith("an alias of math")
    rows = {line.split()[0]: line for line in lines if line and not line.startswith(" ")}
    assert "inline" in rows["synthetic"] and "worker process, needs math_verify" in rows["math"]
    assert "+1.0 if the response's last" in rows["dapo"] and "-1.0 (also with no answer line)" in rows["dapo"]
    assert "fn(sample, text, metadata, **options) -> float" in proc.stdout
    assert "fn(prompts, completions, **kwargs) -> list[float]" in proc.stdout


def test_a_plugin_that_does_not_import_is_one_line() -> None:
    proc = subprocess.run([*CLI, "--plugin", "no_such_module_here"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "megatron-rl rewards: error: --plugin no_such_module_here: cannot import it (No module named "
        "'no_such_module_here')"
    ]
