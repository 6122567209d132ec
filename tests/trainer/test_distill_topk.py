"""Top-k distillation (`algo.distill.top_k`): each kind of teacher returns its top-k next tokens and their log-probs
as transformers' float64 log-softmax of the teacher checkpoint gives them, the ids travel with the samples into the
batch, and the loop trains on the loss term (eq. 3 of `algorithms.distillation`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe
from tests.hf_reference import as_samples, as_token_batch, make_samples
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.trainer.test_distill_step import TEACHER_TOL, _train

K = 5


def hf_topk(model_dir: Path, rows: list[dict], k: int = K) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample: transformers' float64 top-k (ids, log-probs) `[len - 1, k]` of positions 1..len-1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in rows:
        with torch.no_grad():
            logits = model(torch.tensor(row["input_ids"]).unsqueeze(0)).logits[0, :-1].double()
        logp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
        out.append((ids, logp))
    return out


def assert_topk_matches(ids: torch.Tensor, logp: torch.Tensor, rows: list[dict], reference: list) -> None:
    """`ids`/`logp` `[n, T, k]` in the batch layout (position t: token t given tokens[:t]) against `reference`."""
    for i, (want_ids, want_logp) in enumerate(reference):
        n = len(rows[i]["input_ids"])
        assert torch.equal(ids[i, 1:n], want_ids), f"sample {i}: top-{K} ids differ"
        assert (logp[i, 1:n].double() - want_logp).abs().max() < TEACHER_TOL
        assert torch.equal(ids[i, 0], torch.zeros(K, dtype=ids.dtype))


@pytest.mark.usefixtures("megatron_world")
def test_the_megatron_teacher_returns_transformers_top_k(tmp_path: Path) -> None:
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.megatron_backend.actor.reference import reference_from_hf
    from megatron_rl.parallel_layout import ParallelLayout

    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", seed=2)
    actor = MegatronActor.from_hf(student, ParallelLayout(), model_options=ModelOptions(dtype="fp32"))
    rows = make_samples(TinyQwen3MoeSpec().vocab_size, n=4, seed=3)
    batch = as_token_batch(rows)
    with reference_from_hf(actor, teacher).swapped_in() as scoring:
        scored = scoring.compute_log_probs(batch, top_k=K)
    assert scored.topk_ids is not None and scored.topk_log_probs is not None
    assert_topk_matches(scored.topk_ids, scored.topk_log_probs, rows, hf_topk(teacher, rows))


def test_a_local_engine_teacher_returns_transformers_top_k_into_the_batch(tmp_path: Path) -> None:
    from megatron_rl.rollout.engines.local_engine import LocalEngine
    from megatron_rl.rollout.teacher_scores import add_teacher_log_probs
    from megatron_rl.trainer.step.rl_batch import samples_to_batch

    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", TinyQwen3MoeSpec(num_hidden_layers=3), seed=2)
    rows = make_samples(TinyQwen3MoeSpec().vocab_size, n=4, seed=3)
    samples = as_samples(rows)
    engine = LocalEngine(teacher, device=torch.device("cpu"), weight_version="step-0")
    try:
        add_teacher_log_probs(engine, samples, top_k=K)
    finally:
        engine.shutdown()
    batch = samples_to_batch(samples, advantages=torch.zeros(len(samples)))
    fields = batch.fields
    assert fields["teacher_topk_ids"].shape == (*fields["loss_mask"].shape, K)
    assert_topk_matches(fields["teacher_topk_ids"], fields["teacher_topk_log_probs"], rows, hf_topk(teacher, rows))
    # the top-1 log-prob bounds the sampled token's (the same distribution)
    valid = fields["loss_mask"] > 0
    assert bool((fields["teacher_log_probs"][valid] <= fields["teacher_topk_log_probs"][..., 0][valid] + 1e-6).all())


@pytest.mark.parametrize("served_by", ["megatron", "local_engine"])
def test_top_k_distillation_trains_in_the_loop(tmp_path: Path, served_by: str) -> None:
    """Top-k alone (`coef=0`, no task reward): the step logs `distill/topk_kl` (> 0 for another teacher), the
    first update is exactly on-policy, and the run stops nowhere."""
    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", seed=2)
    proc = _train(tmp_path / "run", student, f"algo.distill.teacher={teacher}", f"algo.distill.served_by={served_by}",
                  f"algo.distill.top_k={K}", "algo.distill.coef=0", "algo.distill.task_rewards=false")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["actor/ppo_kl_first"] == 0.0 and row["distill/topk_kl"] > 0.1
        assert row["distill/reverse_kl"] > 0.1  # logged also when its advantage weight is 0


def test_coef_zero_without_a_top_k_term_is_refused() -> None:
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.loader import load_config

    with pytest.raises(ConfigError, match="leaves the teacher unused"):
        load_config(None, ["model.hf_path=unused", "algo.distill.teacher=/t", "algo.distill.coef=0"])
