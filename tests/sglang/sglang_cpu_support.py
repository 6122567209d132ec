"""How the tests launch a CPU SGLang server: the test shims of support/ on PYTHONPATH and CPU flags (test support)."""

from __future__ import annotations

import os
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"
REPO = Path(__file__).resolve().parents[2]


def sglang_python() -> str | None:
    """The SGLang venv's Python: `$MEGATRON_RL_SGLANG_PYTHON`, else `.venv-sglang/bin/python` in the repository."""
    python = os.environ.get("MEGATRON_RL_SGLANG_PYTHON") or str(REPO / ".venv-sglang" / "bin" / "python")
    return python if Path(python).exists() else None


def cpu_launch_env() -> dict[str, str]:
    """Environment of a CPU SGLang server: the test shims of tests/sglang/support/ first on PYTHONPATH."""
    shims = [SUPPORT / "sgl_kernel_stub", SUPPORT / "torchvision_stub", SUPPORT / "cudart_stub"]
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "MEGATRON_RL_TEST_STUB_CUDART": "1",
        "PYTHONPATH": os.pathsep.join(str(p) for p in shims),
        "OMP_NUM_THREADS": "1",
    }


CPU_SERVER_ARGS = (
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--disable-overlap-schedule",
    "--max-total-tokens",
    "4096",
    "--enable-return-routed-experts",
    "--skip-server-warmup",
)


def cpu_python_wrapper(path: Path, sglang_python: str) -> Path:
    """An executable that runs `sglang_python` in the CPU environment above: for code that launches servers
    itself (the trainer, the SLURM templates) and must not carry the stand-ins on its own PYTHONPATH."""
    import shlex

    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in cpu_launch_env().items())
    path.write_text(f'#!/bin/sh\n{exports}exec {shlex.quote(sglang_python)} "$@"\n')
    path.chmod(0o755)
    return path
