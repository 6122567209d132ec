"""A frozen side model launched by the trainer (`rollout.side_models` without urls, no SLURM): rank 0 starts a CPU
SGLang server of the judge checkpoint with rollout.sglang's settings and key, `side:judge` in the judge reward
resolves to it, every sample of every step is sent to it, and it is stopped when the run ends. With rollout servers
the trainer launches too, both take the one key file. A distillation teacher named `side:teacher` is launched the
same way and scores every batch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_python_wrapper

from megatron_rl.rollout.sglang.sglang_server import free_port, is_healthy
from megatron_rl.tiny_model import make_tiny_qwen3_moe

pytestmark = pytest.mark.sglang
EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_moe_gspo.yaml"


@pytest.mark.parametrize("engine", ["local", "sglang"])
def test_the_trainer_launches_a_judge_side_model_and_stops_it_at_exit(engine: str, sglang_py: str, tmp_path: Path):
    judge = make_tiny_qwen3_moe(tmp_path / "judge", seed=7)
    policy = make_tiny_qwen3_moe(tmp_path / "policy", seed=1)
    python = cpu_python_wrapper(tmp_path / "python", sglang_py)
    out = tmp_path / "run"
    reward = ('data.reward=[{name: synthetic}, {name: judge, weight: 0.5, options: {url: "side:judge", '
              'template: "{response} Verdict:", max_new_tokens: 4, retries: 0}}]')  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
         f"model.hf_path={policy}", "warmup.sft_steps=0", "trainer.steps=2", "rollout.prompts_per_step=2",
         "rollout.n_samples=2", "data.eval=null", "data.eval_every=0", "trainer.save_every=0", "logging.plot=false",
         "logging.wandb=false", f"rollout.side_models=[{{name: judge, hf_path: {judge}}}]", reward,
         "data.reward_failure_limit=1.0", f"rollout.sglang.python={python}",
         f"rollout.sglang.extra_args=[{','.join(CPU_SERVER_ARGS)}]", "rollout.sglang.startup_timeout_s=300",
         f"rollout.engine={engine}", f"rollout.sglang.base_port={free_port()}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/judge_errors" in r for r in rows)
    (log,) = (out / "side_models" / "judge").glob("sglang_0_*.log")
    judged = log.read_text()
    assert judged.count('"POST /v1/chat/completions HTTP/1.1" 200') == 8, judged[-3000:]  # 2 steps x 4 samples
    assert (out / ".rollout_api_key").stat().st_mode & 0o077 == 0  # the key the server and the judge share
    port = re.search(r"sglang_0_(\d+)\.log", log.name).group(1)  # type: ignore[union-attr]
    assert not is_healthy(f"http://127.0.0.1:{port}")  # stopped with the run


def test_a_distillation_teacher_named_side_teacher_is_launched_and_scores_every_batch(sglang_py: str, tmp_path: Path):
    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", seed=7)
    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    python = cpu_python_wrapper(tmp_path / "python", sglang_py)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
         f"model.hf_path={student}", "warmup.sft_steps=0", "trainer.steps=2", "rollout.prompts_per_step=2",
         "rollout.n_samples=2", "data.eval=null", "data.eval_every=0", "trainer.save_every=0", "logging.plot=false",
         "logging.wandb=false", f"rollout.side_models=[{{name: teacher, hf_path: {teacher}}}]",
         f"algo.distill.teacher={teacher}", "algo.distill.served_by=sglang", "algo.distill.sglang_urls=[side:teacher]",
         f"rollout.sglang.python={python}", f"rollout.sglang.extra_args=[{','.join(CPU_SERVER_ARGS)}]",
         "rollout.sglang.startup_timeout_s=300"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["distill/reverse_kl"] > 0.1 for r in rows)  # another model: far from 0
    (log,) = (out / "side_models" / "teacher").glob("sglang_0_*.log")
    assert log.read_text().count('"POST /generate HTTP/1.1" 200') >= 2  # one prefill of each step's batch at least
