#!/usr/bin/env bash
# Lean CPU install of SGLang 0.5.23 into its own virtualenv (default .venv-sglang), for `pytest -m sglang`.
#
# SGLang pins torch==2.14.1 (CUDA build) and the whole CUDA stack; on CPU we install the CPU torch 2.13 and
# sglang with --no-deps plus the explicit list below of what its server imports ("lean install", ~3 GB).
# The server then still needs the CPU-only test shims in tests/sglang/support/ (see its README).
# Usage: bash scripts/install_sglang_cpu.sh [VENV_DIR]
set -euo pipefail

VENV_DIR="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
start=$(date +%s)

if [ ! -x "$VENV_DIR/bin/python" ]; then
  "$PYTHON" -m venv "$VENV_DIR"
fi
PIP=("$VENV_DIR/bin/python" -m pip install --disable-pip-version-check -q)

"${PIP[@]}" --upgrade pip wheel setuptools
"${PIP[@]}" torch==2.13.0              # CPU build (torch_cpu wheel from the local pip config on CI machines)
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" torch==2.13.0 aiohttp anthropic blobfile build compressed-tensors==0.18.0 einops fastapi gguf interegular \
  llguidance msgspec ninja numpy openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging \
  partial_json_parser pillow prometheus-client psutil pybase64 pydantic python-multipart pyzmq regex requests \
  scipy sentencepiece==0.2.1 setproctitle tiktoken tokenizers==0.23.2 transformers==5.19.0 uvicorn uvloop \
  watchfiles xgrammar==0.2.7 xxhash zstandard triton smg-grpc-servicer mistral_common python-dateutil distro \
  easydict numba==0.65.1 apache-tvm-ffi==0.1.11 safetensors huggingface_hub IPython dill soundfile
# The Rust router (CPU-capable, small); the SGLang tier tests it, so a failed install fails here.
"${PIP[@]}" torch==2.13.0 sglang-router==0.3.2

"$VENV_DIR/bin/python" -c "import torch, sglang; print('sglang', sglang.__version__, 'torch', torch.__version__)"
end=$(date +%s)
echo "installed into $VENV_DIR in $((end - start)) s, $(du -sh "$VENV_DIR" | cut -f1)"
