"""The healthy weight-sync probe error against a real CPU SGLang server, for docs/reliability.md's tolerances.

    python tests/sglang/scripts/measure_probe_tolerance.py DTYPE STEPS OUT_DIR [key=value ...]

launches one server computing in DTYPE (float32, bfloat16), runs the tiny demo for STEPS steps against it with
every sync verified and the tolerances lifted (`train_sglang_probe.py`, `PROBE_MEASURE=1`), and prints the max
over the syncs of `sync/probe_logp_diff_max` and `sync/probe_logp_diff_mean`, and the mean `time/sync_probe` and
`time/step`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from sglang_cpu_support import CPU_SERVER_ARGS, REPO, cpu_launch_env, sglang_python  # noqa: E402

from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers  # noqa: E402
from megatron_rl.tiny_model import make_tiny_qwen3_moe  # noqa: E402


def main(dtype: str, steps: int, out: Path, overrides: list[str]) -> None:
    model = make_tiny_qwen3_moe(out / "model", seed=1234)
    args = list(CPU_SERVER_ARGS)
    args[args.index("--dtype") + 1] = dtype
    launch = SGLangLaunchConfig(model_path=str(model), python=sglang_python() or "python3", extra_args=tuple(args),
                                env=cpu_launch_env(), log_dir=str(out / "logs"), startup_timeout_s=600)  # fmt: skip
    with SGLangServers.launch(launch) as servers:
        cmd = [
            sys.executable, str(HERE / "train_sglang_probe.py"), "train", str(REPO / "examples" / "tiny_moe_gspo.yaml"),
            f"trainer.output_dir={out / 'run'}", f"model.hf_path={model}", "rollout.engine=sglang",
            f"rollout.sglang.urls=[{servers.urls[0]}]", f"rollout.sglang.api_key_file={servers.api_key_file}",
            f"trainer.steps={steps}", "rollout.verify_sync_every=1", "data.eval=null", "data.eval_every=0",
            "trainer.save_every=0", "logging.wandb=false", "logging.plot=false", *overrides,
        ]  # fmt: skip
        proc = subprocess.run(cmd, env={**os.environ, "PROBE_MEASURE": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(proc.stdout[-2000:] + proc.stderr[-4000:])
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    verified = [r for r in rows if "sync/probe_logp_diff_max" in r]
    result = {
        "dtype": dtype,
        "steps": len(rows),
        "verified_rows": len(verified),
        "probe_logp_diff_max": max(r["sync/probe_logp_diff_max"] for r in verified),
        "probe_logp_diff_mean_max": max(r["sync/probe_logp_diff_mean"] for r in verified),
        "time_sync_probe_per_sync": sum(r["time/sync_probe"] for r in verified) / (len(rows) + 1),  # + start-up
        "time_step_mean": sum(r["time/step"] for r in rows) / len(rows),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
