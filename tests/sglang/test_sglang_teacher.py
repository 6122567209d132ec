"""A distillation teacher served by a real SGLang server (`algo.distill.served_by: sglang`, CPU, test shims): its
prefill log-probs of the samples' tokens agree with transformers' scores of the teacher checkpoint within this
tier's fp32 tolerance, its top-k (`input_top_logprobs`) are transformers' top-k, and a `megatron-rl train` run
distils from it (the student on the local engine), with the top-k term."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env

from megatron_rl.config import load_config
from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers
from megatron_rl.rollout.teacher_scores import add_teacher_log_probs
from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe
from megatron_rl.trainer.rollout_phase import teacher_engine
from megatron_rl.trainer.step.rl_batch import samples_to_batch
from tests.hf_reference import as_samples, hf_score, make_samples

pytestmark = pytest.mark.sglang
EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_moe_gspo.yaml"
LOGPROB_ATOL = 2e-3  # fp32 torch_native attention vs transformers eager (test_sglang_server.py)
K = 4  # top-k distillation's k


def hf_log_softmax(model_dir: Path, rows: list[dict]) -> list[torch.Tensor]:
    """Per sample: transformers' float64 log-softmax `[len - 1, V]` of positions 1..len-1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([r["input_ids"]])).logits[0, :-1].double(), -1) for r in rows]


@pytest.fixture(scope="module")
def teacher_url(sglang_py: str, tmp_path_factory: pytest.TempPathFactory):
    teacher = make_tiny_qwen3_moe(tmp_path_factory.mktemp("sgl_teacher") / "teacher", seed=7)
    config = SGLangLaunchConfig(
        model_path=str(teacher), python=sglang_py, extra_args=CPU_SERVER_ARGS, env=cpu_launch_env(),
        log_dir=str(teacher.parent / "logs"), startup_timeout_s=240,
    )  # fmt: skip
    servers = SGLangServers.launch(config)
    try:
        yield teacher, servers.urls[0], f"rollout.sglang.api_key_file={servers.api_key_file}"
    finally:
        servers.stop()


def test_the_sglang_teacher_scores_the_samples_as_transformers_scores_the_teacher(teacher_url, tmp_path: Path) -> None:
    teacher, url, key = teacher_url
    cfg = load_config(EXAMPLE, [f"trainer.output_dir={tmp_path}", f"algo.distill.teacher={teacher}",
                                "algo.distill.served_by=sglang", f"algo.distill.sglang_urls=[{url}]", key])  # fmt: skip
    rows = make_samples(TinyQwen3MoeSpec().vocab_size, n=4, seed=3)
    samples = as_samples(rows)
    with ExitStack() as closing:
        engine = teacher_engine(cfg, closing)
        assert engine is not None
        add_teacher_log_probs(engine, samples, top_k=K)
    batch = samples_to_batch(samples, advantages=torch.zeros(len(samples)))
    for i, reference in enumerate(hf_score(teacher, rows)):
        start, end = rows[i]["response_start"], len(rows[i]["input_ids"])
        got = batch.fields["teacher_log_probs"][i, start:end].double()
        assert (got - reference["log_probs"]).abs().max() < LOGPROB_ATOL
    # top-k: SGLang's log-probs at its ids are transformers' log-softmax there, and its k values are transformers'
    # k largest (robust to the order of near ties, which fp32 rounding may swap)
    for i, full in enumerate(hf_log_softmax(teacher, rows)):
        n = len(rows[i]["input_ids"])
        ids, logp = batch.fields["teacher_topk_ids"][i, 1:n], batch.fields["teacher_topk_log_probs"][i, 1:n].double()
        assert (logp - full.gather(-1, ids)).abs().max() < LOGPROB_ATOL
        assert (logp - full.topk(K, dim=-1).values).abs().max() < LOGPROB_ATOL


def test_a_run_distils_from_an_sglang_teacher(teacher_url, tmp_path: Path) -> None:
    teacher, url, key = teacher_url
    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
         f"model.hf_path={student}", "warmup.sft_steps=0", "trainer.steps=2", "data.eval=null", "data.eval_every=0",
         "trainer.save_every=0", "logging.plot=false", f"algo.distill.teacher={teacher}",
         "algo.distill.served_by=sglang", f"algo.distill.sglang_urls=[{url}]", f"algo.distill.top_k={K}", key],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["distill/reverse_kl"] > 0.1 for r in rows)  # another model: far from 0
    assert all(r["distill/topk_kl"] > 0.1 for r in rows)
    assert rows[0]["actor/ppo_kl_first"] == 0.0
