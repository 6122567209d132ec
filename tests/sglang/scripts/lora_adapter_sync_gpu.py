"""`rollout.lora_sync=adapter` for real, on one GPU (scripts/gpu_check.sh runs it): SGLang serves the trainer's LoRA.

The tiny Qwen3-MoE, a one-process actor with rank-8 adapters on attention, and an SGLang server launched by the
run's own engine factory (`--enable-lora ...`, its flags from the config). `WeightSync` sends the base and the
adapter (step 0, B = 0), then after a LoRA update (B drawn) the adapter alone (step 1); the verifier checks both
syncs against the actor's log-probs (the per-dtype tolerance). A control: the served log-probs at step 1 are
nearer the adapted actor's than the base's. Writes $OUT/lora_adapter_sync.json; exits 1 when a check fails.

    python tests/sglang/scripts/lora_adapter_sync_gpu.py SGLANG_PYTHON OUT_DIR [SGLANG_FLAG ...]
(further flags for the server; default `--dtype bfloat16`)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(diffs) / len(diffs)


def main(sglang_python: str, out: Path, flags: list[str]) -> int:
    from megatron_rl.config import load_config
    from megatron_rl.config.sampling import SamplingParams
    from megatron_rl.megatron_backend import platform
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed
    from megatron_rl.megatron_backend.lora.adapters import adapters_off, lora_modules
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.rollout.engines.engine_factory import build_engine, sglang_server_flags
    from megatron_rl.tiny_model import make_tiny_qwen3_moe
    from megatron_rl.trainer.guards.sync_verification import SyncVerifier, probe_log_probs
    from megatron_rl.trainer.rollout_phase import WeightSync, engine_run

    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_qwen3_moe(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    cfg = load_config(None, [
        f"model.hf_path={model}", "model.options.layer_spec=local", "model.lora.rank=8",
        "model.lora.targets=[attention]", "rollout.engine=sglang", "rollout.lora_sync=adapter",
        "trainer.colocate=true", f"rollout.sglang.python={sglang_python}", "rollout.sglang.mem_fraction_static=0.3",
        f"trainer.output_dir={out / 'run'}", f"rollout.sglang.extra_args=[{','.join(flags)}]",
    ])  # fmt: skip
    init_distributed(ParallelLayout(), seed=1)
    actor = MegatronActor.from_hf(model, ParallelLayout(), lora=cfg.model.lora)
    probe = [[(7 * i + 3 * j) % 100 + 4 for j in range(24)] for i in range(8)]
    report: dict = {}
    engine = None
    try:
        engine = build_engine(cfg.rollout, engine_run(cfg), model, platform.device())
        report["flags"] = sglang_server_flags(cfg.rollout, engine_run(cfg))
        verifier = SyncVerifier("every", 1, probe)
        sync = WeightSync(actor, engine, cfg.rollout, verifier)
        sync.send(0)  # the base (adapters off) and the adapter
        report["step0"] = sync.pop_metrics()
        with torch.no_grad():
            for lora in lora_modules(actor.chunks):  # a LoRA update
                for b in lora.B:
                    b.normal_(0, 0.05)
        sync.send(1)  # the adapter alone; verified (a mismatch raises WeightSyncMismatch)
        report["step1"] = sync.pop_metrics()
        (served,) = engine.score_prompts(probe)
        adapted = probe_log_probs(actor, probe)
        with adapters_off(actor.chunks):
            base = probe_log_probs(actor, probe)
        report["served_vs_adapted_mean"] = _mean_abs(served.log_probs, adapted)
        report["served_vs_base_mean"] = _mean_abs(served.log_probs, base)
        samples = engine.generate(probe[:2], SamplingParams(max_new_tokens=8, temperature=1.0), n=2)
        report["sample_versions"] = sorted({s.weight_version for s in samples})
        ok = (report["step1"]["sync/full_syncs"] == 0 and report["served_vs_adapted_mean"] * 3
              < report["served_vs_base_mean"] and report["sample_versions"] == ["step-1"])  # fmt: skip
    except Exception as err:  # noqa: BLE001 (reported in the JSON, then the exit status)
        report["error"], ok = repr(err), False
    finally:
        if engine is not None:
            engine.shutdown()
    report["ok"] = ok
    (out / "lora_adapter_sync.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:] or ["--dtype", "bfloat16"]))
