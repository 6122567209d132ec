#!/usr/bin/env bash
# One short GPU check (< 10 min) for the device machine: megatron-core 0.19.2 on CUDA + NCCL (1 GPU).
#
# Prepare here (CPU machine), once:
#   pip download megatron-core==0.19.2 --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_28_x86_64 -d .gpu_wheels
#   (.gpu_wheels/ is git-ignored; pass it in the device tool's `carry`.)
# Run there:  bash scripts/gpu_check.sh      (results under $OUT, default ./gpu_check_out)
#
# What it checks, all on CUDA: the Qwen3-MoE HF parity of `megatron-rl logprobs` (log-probs, entropy,
# routed experts vs transformers, with packed (THD through Transformer Engine's attention) and padded
# micro-batches), the single-process actor invariants (export bitwise, ppo_kl == 0 on the first update, loss
# falls, reference swap, packed vs padded within 1e-6), with the TE layer spec when Transformer Engine imports
# and the local spec otherwise; the kernel tests compiled by Triton (not the interpreter) and the log-prob
# kernel benchmark (time, peak memory, GB/s against HBM), the packed GSPO loss benchmark, the RL step's per-phase
# breakdown on the demo (benchmarks/bench_rl_step.py: rollout, old log-probs, updates, sync; JSON copied to $OUT);
# the optimizer CPU offload (Megatron's HybridDeviceOptimizer with the precision-aware optimizer): three updates
# match the resident optimizer's within bf16 rounding with the state in host memory, and a checkpoint resume
# with it continues bit for bit (tests/megatron_backend/actor/test_optimizer_offload.py; these skip without Transformer Engine,
# which the precision-aware optimizer needs: environment.txt says whether it imported); LoRA served by SGLang
# (rollout.lora_sync=adapter: the base, then the adapters alone, verified against the actor's log-probs;
# tests/sglang/scripts/lora_adapter_sync_gpu.py) when an SGLang GPU install imports ($MEGATRON_RL_SGLANG_PYTHON, else
# python3), else lora_adapter_sync.txt says it was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
    nvidia-smi
    python3 -m pip install -q --no-deps --no-index --find-links .gpu_wheels "megatron-core==0.19.2"
    python3 -m pip install -q --no-deps --no-build-isolation -e .
    python3 - <<'PY'
import importlib.metadata as m, torch
from megatron_rl.optional_deps import is_available
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("megatron-core", m.version("megatron-core"), "transformer_engine", is_available("transformer_engine.pytorch"))
PY
} 2>&1 | tee "$OUT/environment.txt"
# -o addopts=: one process on the one GPU, and no need for pytest-xdist there.
python3 -m pytest -q -p no:cacheprovider -o addopts= \
    tests/commands/test_logprobs_cli.py::test_logprobs_match_transformers \
    tests/commands/test_logprobs_cli.py::test_replay_routes_reproduces_recording_and_catches_misalignment \
    tests/megatron_backend/actor/test_layouts.py::test_single_process_invariants \
    tests/kernels tests/trainer/test_rl_loss.py \
    tests/megatron_backend/actor/test_offload.py tests/megatron_backend/actor/test_optimizer_offload.py \
    -rs 2>&1 | tee "$OUT/pytest.txt"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.txt"
SGLANG_PY="${MEGATRON_RL_SGLANG_PYTHON:-python3}"
if "$SGLANG_PY" -c "import sglang, sgl_kernel" 2>/dev/null; then
    timeout 240 python3 tests/sglang/scripts/lora_adapter_sync_gpu.py "$SGLANG_PY" "$OUT" 2>&1 \
        | tee "$OUT/lora_adapter_sync.txt"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/lora_adapter_sync.txt"
else
    echo "skipped: $SGLANG_PY cannot import sglang and sgl_kernel (no SGLang GPU install)" | tee "$OUT/lora_adapter_sync.txt"
fi
timeout 300 python3 benchmarks/bench_logprob.py 2>&1 | tee "$OUT/bench_logprob.txt"
timeout 120 python3 benchmarks/bench_gspo.py 2>&1 | tee "$OUT/bench_gspo.txt"
# The RL step per phase (rollout, old log-probs, updates, weight sync) on the demo, as on CPU (P19's breakdown).
timeout 240 python3 benchmarks/bench_rl_step.py --steps 10 2>&1 | tee "$OUT/bench_rl_step.txt"
cp benchmarks/results/bench_logprob_*.json benchmarks/results/bench_gspo_*.json benchmarks/results/rl_step_*.json \
    "$OUT/" 2>/dev/null || true
