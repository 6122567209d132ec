#!/usr/bin/env bash
# Test tier: run the Megatron tests against megatron-core 0.19.2, the release GPU clusters use.
#
# 0.19.x declares Requires-Python >= 3.12 but ships a cp311 wheel whose megatron.core works on 3.11
# (nothing in it needs 3.12 at run time). We install it without dependencies into a virtual
# environment layered on the current one, so everything else (torch, transformers) is shared.
# Usage: scripts/test_megatron_core_019.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MCORE019_VENV:-.venv-mcore019}"
if [ ! -x "$VENV/bin/python" ]; then
    python -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/pip" install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import importlib.metadata as m; v = m.version('megatron-core'); assert v == '0.19.2', v; print('megatron-core', v)"
# Tests marked same_on_every_megatron exercise only our own code around Megatron (the default tier runs them).
"$VENV/bin/python" -m pytest -q -m "not sglang and not slurm and not slow and not same_on_every_megatron" \
    tests/megatron_backend tests/models tests/formats tests/commands tests/test_parallel_layout.py \
    tests/kernels/test_vocab_parallel.py "$@"
