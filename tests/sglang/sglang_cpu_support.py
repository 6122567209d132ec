"""How the tests launch a CPU SGLang server: the test shims of support/ on PYTHONPATH and CPU flags (test support)."""

from __future__ import annotations

import os
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"


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
