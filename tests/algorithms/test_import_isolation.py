"""megatron_rl.algorithms is pure torch: importing it must not pull in Megatron, SGLang or Transformer Engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import megatron_rl.algorithms
forbidden = ("megatron", "sglang", "transformer_engine")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
assert not loaded, loaded
assert not any(m.startswith("megatron.core") for m in sys.modules)
"""


def test_no_megatron_sglang_or_transformer_engine_import():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
