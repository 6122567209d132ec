"""The `megatron-rl` entry point: --help, --version, subcommand list, doctor."""

from __future__ import annotations

import subprocess
import sys

from megatron_rl import __version__

CLI = [sys.executable, "-m", "megatron_rl.cli"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_version() -> None:
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"megatron-rl {__version__}"


def test_help_lists_subcommands_without_importing_megatron() -> None:
    proc = _run("--help")
    assert proc.returncode == 0
    for name in ("train", "logprobs", "doctor"):
        assert name in proc.stdout
    code = "import sys; from megatron_rl.cli import build_parser; build_parser(); print('megatron.core' in sys.modules)"
    check = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert check.stdout.strip() == "False"


def test_doctor_reports_versions() -> None:
    proc = _run("doctor")
    assert proc.returncode == 0
    assert "megatron-core support  ok" in proc.stdout
    assert "wandb mode" in proc.stdout


def test_train_help_config_lists_every_section() -> None:
    proc = _run("train", "--help-config")
    assert proc.returncode == 0
    for key in ("algo.preset", "rollout.n_samples", "trainer.steps", "parallel.tp", "optimizer.lr"):
        assert key in proc.stdout


def test_unknown_subcommand_fails() -> None:
    proc = _run("nonsense")
    assert proc.returncode != 0 and "invalid choice" in proc.stderr


def test_models_lists_every_registered_family() -> None:
    from megatron_rl.models import supported_families

    proc = _run("models")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for family in supported_families():
        row = next((line for line in lines if line.startswith(family.model_type + " ")), None)
        assert row is not None, f"{family.model_type} missing from `megatron-rl models`"
        assert family.hf_architecture in row and family.supports in row
