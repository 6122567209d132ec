"""A Megatron distillation teacher of another architecture (`megatron_backend/actor/teacher.py`): a second, frozen,
forward-only model resident in the actor's parallel layout. Its log-probs of the student's tokens are transformers'
fp32 scores of the teacher checkpoint (< 1e-5) at TP=1 and at TP=2 with sequence parallelism (torchrun), whose
log-probs and top-4 also equal TP=1's; building it leaves the student's scores and every random generator as they
were. A teacher of the student's architecture is still swapped in from the host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe
from tests.dist_harness import run_torchrun
from tests.hf_reference import hf_score, make_samples
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

SCRIPT = Path(__file__).parent / "scripts" / "teacher_layout_check.py"
# Another size of the student's family: wider, deeper, fewer experts.
TEACHER = TinyQwen3MoeSpec(hidden_size=96, intermediate_size=192, moe_intermediate_size=48, num_hidden_layers=3,
                           num_experts=4)  # fmt: skip
TOL = 1e-5  # fp32 on both sides, different kernels and summation orders


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The student, a teacher of another size, the samples and their padded batch (as JSON for the script)."""
    base = tmp_path_factory.mktemp("teacher")
    samples = make_samples(TinyQwen3MoeSpec().vocab_size, n=5, seed=3)
    width = max(len(s["input_ids"]) for s in samples)
    batch = {
        "input_ids": [s["input_ids"] + [0] * (width - len(s["input_ids"])) for s in samples],
        "lengths": [len(s["input_ids"]) for s in samples],
        "response_starts": [s["response_start"] for s in samples],
    }
    (base / "batch.json").write_text(json.dumps(batch))
    return {
        "student": make_tiny_qwen3_moe(base / "student", seed=1),
        "teacher": make_tiny_qwen3_moe(base / "teacher", TEACHER, seed=2),
        "samples": samples,
        "batch": base / "batch.json",
    }


@pytest.fixture(scope="module")
def single_process(models: dict, megatron_world: object) -> dict:  # noqa: F811 (the fixture above)
    """TP=1 in this process: the teacher, its scores (log-probs, top-4) and the student's before and after."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_rl.config.options import ModelOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.actor.teacher import teacher_from_hf
    from megatron_rl.parallel_layout import ParallelLayout

    actor = MegatronActor.from_hf(models["student"], ParallelLayout(), model_options=ModelOptions(dtype="fp32"))
    rows = json.loads(models["batch"].read_text())
    batch = TokenBatch(*(torch.tensor(rows[k]) for k in ("input_ids", "lengths", "response_starts")))
    own_before = actor.compute_log_probs(batch).log_probs
    cpu, tracker = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    teacher = teacher_from_hf(actor, models["teacher"])
    random_kept = torch.equal(torch.get_rng_state(), cpu) and all(
        torch.equal(state, tracker[name]) for name, state in get_cuda_rng_tracker().get_states().items()
    )
    with teacher.swapped_in() as scoring:
        scored = scoring.compute_log_probs(batch, top_k=4)
    return {"actor": actor, "teacher": teacher, "scored": scored, "own_before": own_before,
            "own_after": actor.compute_log_probs(batch).log_probs, "random_kept": random_kept}  # fmt: skip


def _assert_matches_transformers(log_probs: torch.Tensor, models: dict) -> None:
    samples = models["samples"]
    for i, reference in enumerate(hf_score(models["teacher"], samples)):
        start, end = samples[i]["response_start"], len(samples[i]["input_ids"])
        assert (log_probs[i, start:end].double() - reference["log_probs"]).abs().max() < TOL


def test_a_teacher_of_another_size_is_resident_and_scores_as_transformers(single_process: dict, models: dict) -> None:
    from megatron_rl.megatron_backend.actor.teacher import ResidentTeacher

    teacher = single_process["teacher"]
    assert isinstance(teacher, ResidentTeacher) and teacher.model.optimizer is None
    assert teacher.model.dims.num_layers == 3 and teacher.model.dims.hidden_size == 96
    assert not any(p.requires_grad for m in teacher.model.modules for p in m.parameters())
    _assert_matches_transformers(single_process["scored"].log_probs, models)
    assert torch.equal(single_process["own_after"], single_process["own_before"])  # the student is untouched
    assert single_process["random_kept"]


def test_a_teacher_of_the_students_architecture_is_swapped_in_from_the_host(single_process: dict, models: dict,
                                                                             tmp_path: Path) -> None:  # fmt: skip
    from megatron_rl.megatron_backend.actor.reference import ReferenceWeights
    from megatron_rl.megatron_backend.actor.teacher import teacher_from_hf

    same = make_tiny_qwen3_moe(tmp_path / "same", seed=5)
    assert isinstance(teacher_from_hf(single_process["actor"], same), ReferenceWeights)


@pytest.mark.torchrun
def test_the_resident_teacher_at_tp2_scores_as_at_tp1(single_process: dict, models: dict, tmp_path: Path) -> None:
    out = tmp_path / "tp2.json"
    run_torchrun(SCRIPT, 2, ["--student", str(models["student"]), "--teacher", str(models["teacher"]), "--batch",
                             str(models["batch"]), "--out", str(out), "--tp", "2"], timeout=300)  # fmt: skip
    tp2 = json.loads(out.read_text())
    assert tp2["resident"]
    log_probs = torch.tensor(tp2["log_probs"])
    _assert_matches_transformers(log_probs, models)
    tp1 = single_process["scored"]
    assert (log_probs - tp1.log_probs).abs().max() < TOL
    assert torch.equal(torch.tensor(tp2["topk_ids"]), tp1.topk_ids)
    assert (torch.tensor(tp2["topk_log_probs"]) - tp1.topk_log_probs).abs().max() < TOL
