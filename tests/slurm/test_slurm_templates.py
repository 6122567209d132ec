"""The SLURM templates on a real single-node SLURM (slurm-wlm: slurmctld + slurmd + munge on localhost).

Set up with `bash scripts/slurm/local_cluster.sh`; run with `pytest -m slurm tests/slurm` (what .ci/run does).
Skipped when no cluster answers. The CPU demo runs through scripts/slurm/colocated.sbatch as 2 trainer ranks
(gloo): the job completes with per-role logs and a checkpoint; a job cancelled mid-run and submitted again
resumes from its last checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "scripts" / "slurm" / "colocated.sbatch"


@pytest.fixture(scope="module")
def cluster() -> str:
    try:
        info = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no SLURM here: run `bash scripts/slurm/local_cluster.sh`")
    if info.returncode != 0 or "idle" not in info.stdout:
        pytest.skip(f"SLURM is not ready ({info.stdout.strip() or info.stderr.strip()})")
    return info.stdout.strip()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("slurm") / "model", seed=1234)


def _submit(
    run_dir: Path, model: Path, steps: int, *, wait: bool, extra: str = ""
) -> tuple[int, subprocess.CompletedProcess]:
    overrides = (
        f"model.hf_path={model} warmup.sft_steps=20 trainer.steps={steps} trainer.save_every=1 trainer.keep_last=2 "
        f"rollout.prompts_per_step=4 data.eval=null data.eval_every=0 logging.wandb=false logging.plot=false {extra}"
    )
    env = {**os.environ, "CONFIG": "examples/tiny_moe_gspo.yaml", "RUN_DIR": str(run_dir), "GPUS_PER_NODE": "2",
           "OVERRIDES": overrides}  # fmt: skip
    cmd = ["sbatch", "--parsable", "--nodes=1", "--cpus-per-task=2", "--export=ALL",
           f"--output={run_dir.parent / 'job-%j.out'}", *(["--wait"] if wait else []), str(TEMPLATE)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    job = int(proc.stdout.strip().splitlines()[0].split(";")[0])
    return job, proc


def _job_gone(job: int) -> bool:
    return not subprocess.run(["squeue", "-h", "-j", str(job)], capture_output=True, text=True).stdout.strip()


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_colocated_demo_job_completes(cluster: str, model: Path, tmp_path: Path) -> None:
    """With the colocated memory phases on: both ranks offload their actor shard during rollout, the engine on
    rank 0 frees its weights during training and gets them back through the sync."""
    run = tmp_path / "run"
    job, proc = _submit(run, model, 3, wait=True, extra="trainer.offload_actor=true rollout.release_memory=true")
    assert proc.returncode == 0, (tmp_path / f"job-{job}.out").read_text()[-3000:]
    logs = run / "logs" / f"{job}_0"
    assert "colocated plan: 1 node(s) x 2 GPU(s)" in (logs / "plan.txt").read_text()
    trainer_logs = list(logs.glob("trainer_*.log"))
    assert len(trainer_logs) == 1 and "step 3/3" in trainer_logs[0].read_text()
    assert (run / "checkpoints" / "step_000000003" / "COMPLETE").is_file()
    assert _steps(run) == [1, 2, 3]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["memory/actor_offloaded_gib"] > 0 and "time/engine_release" in record
        assert record["actor/ppo_kl_first"] == 0.0


def test_cancelled_job_resumes_from_its_checkpoint_when_resubmitted(cluster: str, model: Path, tmp_path: Path):
    run = tmp_path / "run"
    first, _ = _submit(run, model, 8, wait=False)
    deadline = time.monotonic() + 600

    def checkpointed() -> bool:
        if (run / "checkpoints" / "step_000000002" / "COMPLETE").is_file():
            return True
        assert not _job_gone(first), "no checkpoint before the job ended"
        return False

    wait_until(checkpointed, deadline - time.monotonic(), "the step-2 checkpoint", interval_s=0.5)
    subprocess.run(["scancel", str(first)], check=True)
    wait_until(lambda: _job_gone(first), deadline - time.monotonic(), "scancel to stop the job", interval_s=0.5)
    # The job step is SIGKILLed KillWait=10 s after scancel (local_cluster.sh).
    pgrep = ["pgrep", "-f", f"trainer.output_dir={run}"]
    wait_until(lambda: not subprocess.run(pgrep, capture_output=True).stdout, 30,
               f"the processes of the cancelled job to end ({' '.join(pgrep)})", interval_s=0.5)  # fmt: skip
    done_before = max(_steps(run))
    assert done_before < 8, "the job finished before it was cancelled: nothing to resume"

    second, proc = _submit(run, model, 8, wait=True)
    assert proc.returncode == 0, (tmp_path / f"job-{second}.out").read_text()[-3000:]
    trainer_log = next((run / "logs" / f"{second}_0").glob("trainer_*.log")).read_text()
    resumed = int(trainer_log.split("at step ")[1].split()[0])
    assert f"resumed from {run / 'checkpoints'}" in trainer_log and resumed >= 2
    steps = _steps(run)
    assert steps[-(8 - resumed) :] == list(range(resumed + 1, 9)), steps  # continued right after the checkpoint
    assert (run / "checkpoints" / "step_000000008" / "COMPLETE").is_file()
    print(f"\nSLURM: job {first} cancelled after step {done_before}; job {second} resumed at step {resumed}")


@pytest.fixture(scope="module")
def sglang_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SGLang venv's Python in the CPU environment of the SGLang tier (its stand-ins), or skip."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "sglang"))
    from sglang_cpu_support import cpu_python_wrapper
    from sglang_cpu_support import sglang_python as find_sglang

    found = find_sglang()
    if found is None:
        pytest.skip("SGLang venv absent: run `bash scripts/install_sglang_cpu.sh`")
    return str(cpu_python_wrapper(tmp_path_factory.mktemp("sglang") / "python", found))


def test_disaggregated_job_trains_on_n1_and_serves_on_n2(cluster: str, model: Path, sglang_python: str,
                                                          tmp_path: Path) -> None:  # fmt: skip
    """scripts/slurm/disaggregated.sbatch on 2 nodes: n1 trains (1 rank), n2 runs a real SGLang server (CPU);
    weights go from the trainer to the server over a gloo broadcast group after warm-up and every step. The run is
    asynchronous (trainer.mode=async, one step off-policy): n2 generates step 2's samples while n1 trains step 1."""
    run = tmp_path / "run"
    overrides = (
        f"model.hf_path={model} warmup.sft_steps=100 warmup.sft_lr=2e-3 trainer.steps=2 trainer.save_every=1 "
        "rollout.prompts_per_step=4 data.eval=null data.eval_every=0 logging.wandb=false logging.plot=false "
        "trainer.mode=async"
    )
    env = {**os.environ, "CONFIG": "examples/tiny_moe_gspo.yaml", "RUN_DIR": str(run), "GPUS_PER_NODE": "1",
           "ROLLOUT_NODES": "1", "OVERRIDES": overrides, "SGLANG_PYTHON": sglang_python, "HEALTH_TIMEOUT": "300",
           "SGLANG_EXTRA_ARGS": "--device cpu --dtype float32 --disable-overlap-schedule --max-total-tokens 4096 "
                                "--skip-server-warmup"}  # fmt: skip
    cmd = ["sbatch", "--parsable", "--wait", "--nodes=2", "--cpus-per-task=2", "--export=ALL",
           f"--output={tmp_path / 'job-%j.out'}", str(REPO / "scripts" / "slurm" / "disaggregated.sbatch")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    job = int(proc.stdout.strip().splitlines()[0].split(";")[0])
    out = (tmp_path / f"job-{job}.out").read_text()
    assert proc.returncode == 0, out[-3000:]
    logs = run / "logs" / f"{job}_0"
    plan = (logs / "plan.txt").read_text()
    assert "disaggregated plan: 2 node(s) x 1 GPU(s)" in plan and "node 1: port 30000" in plan
    assert "SGLang servers healthy: http://n2:30000" in out
    trainer_logs = list(logs.glob("trainer_*.log"))  # named by host: both nodes are this machine
    assert (logs / "sglang_n2_30000.log").is_file() and len(trainer_logs) == 1
    assert "step 2/2" in trainer_logs[0].read_text()
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2]
    assert [r["async/staleness_mean"] for r in history] == [0.0, 1.0]  # step 2 trained on version 0's samples
    for r in history:
        assert r["actor/ppo_kl_first"] == 0.0
        # Step 1: the served weights are the trainer's (fp32 both sides); step 2: one version behind.
        assert r["mismatch/logp_abs_diff"] < (1e-3 if r["step"] == 1 else 0.1)
    assert (run / "checkpoints" / "step_000000002" / "COMPLETE").is_file()


def test_disaggregated_job_launches_a_judge_side_model_and_the_trainer_uses_it(
    cluster: str, model: Path, sglang_python: str, tmp_path: Path
) -> None:
    """scripts/slurm/disaggregated.sbatch on 2 nodes x 2 devices: n1 trains (2 ranks), n2 serves the rollout server on
    its first device and a frozen judge (rollout.side_models, another tiny checkpoint, no urls) on its last, both with
    the job's API key. The trainer gets the judge's URL (rollout.side_models.0.urls=[...]); `side:judge` in the judge
    reward resolves to it, and every sample of the step is sent to the judge server (its access log)."""
    import yaml

    judge = make_tiny_qwen3_moe(tmp_path / "judge", seed=7)
    config = yaml.safe_load((REPO / "examples" / "tiny_moe_gspo.yaml").read_text())
    config["rollout"]["side_models"] = [{"name": "judge", "hf_path": str(judge)}]
    config["data"]["reward"] = [
        {"name": "synthetic"},
        {"name": "judge", "weight": 0.5,
         "options": {"url": "side:judge", "template": "{response} Verdict:", "max_new_tokens": 4, "retries": 0}},
    ]  # fmt: skip
    config["data"]["reward_failure_limit"] = 1.0  # a random judge writes no verdict: each reply is a failed sample
    (tmp_path / "judged.yaml").write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    overrides = (
        f"model.hf_path={model} warmup.sft_steps=0 trainer.steps=1 trainer.save_every=1 rollout.prompts_per_step=2 "
        "rollout.n_samples=2 data.eval=null data.eval_every=0 logging.wandb=false logging.plot=false"
    )
    env = {**os.environ, "CONFIG": str(tmp_path / "judged.yaml"), "RUN_DIR": str(run), "GPUS_PER_NODE": "2",
           "ROLLOUT_NODES": "1", "OVERRIDES": overrides, "SGLANG_PYTHON": sglang_python, "HEALTH_TIMEOUT": "300",
           "SGLANG_EXTRA_ARGS": "--device cpu --dtype float32 --disable-overlap-schedule --max-total-tokens 4096 "
                                "--skip-server-warmup"}  # fmt: skip
    cmd = ["sbatch", "--parsable", "--wait", "--nodes=2", "--cpus-per-task=2", "--export=ALL",
           f"--output={tmp_path / 'job-%j.out'}", str(REPO / "scripts" / "slurm" / "disaggregated.sbatch")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    job = int(proc.stdout.strip().splitlines()[0].split(";")[0])
    out = (tmp_path / f"job-{job}.out").read_text()
    assert proc.returncode == 0, out[-3000:]
    logs = run / "logs" / f"{job}_0"
    plan = (logs / "plan.txt").read_text()
    assert "node 1: port 30000, GPUs [0]" in plan and "side model judge: node 1, port 30300, GPUs [1]" in plan
    assert "side models healthy: rollout.side_models.0.urls=[http://n2:30300]" in out
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1] and "reward/judge_errors" in history[0]
    judged = (logs / "side_0_n2_30300.log").read_text()
    assert judged.count('"POST /v1/chat/completions HTTP/1.1" 200') == 4, judged[-3000:]  # 2 prompts x 2 samples
