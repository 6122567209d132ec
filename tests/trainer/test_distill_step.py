"""On-policy distillation with a Megatron teacher (`algo.distill`): the teacher's log-probs of the student's tokens
are transformers' scores of the teacher checkpoint; a teacher with another tokenizer, or of another architecture the
actor's layout cannot run, is refused before the build; in the loop, a teacher equal to the student gives a reverse
KL of exactly 0, and a teacher of another size (resident beside the actor) distils."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe
from tests.hf_reference import as_samples, as_token_batch, hf_score, make_samples
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.shared_runs import EXAMPLE

# fp32 on both sides, different kernels and summation orders: measured below 2e-6 on these tokens
TEACHER_TOL = 1e-5


@pytest.mark.usefixtures("megatron_world")
def test_the_megatron_teacher_scores_the_students_tokens_as_transformers_scores_the_teacher(tmp_path: Path) -> None:
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.megatron_backend.actor.reference import reference_from_hf
    from megatron_rl.parallel_layout import ParallelLayout

    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", seed=2)
    actor = MegatronActor.from_hf(student, ParallelLayout(), model_options=ModelOptions(dtype="fp32"))
    samples = make_samples(TinyQwen3MoeSpec().vocab_size, n=4, seed=3)
    batch = as_token_batch(samples)
    with reference_from_hf(actor, teacher).swapped_in() as scoring:
        taught = scoring.compute_log_probs(batch).log_probs
    own = actor.compute_log_probs(batch).log_probs  # the student's weights are back
    for i, (t, s) in enumerate(zip(hf_score(teacher, samples), hf_score(student, samples), strict=True)):
        start, end = samples[i]["response_start"], len(samples[i]["input_ids"])
        assert (taught[i, start:end].double() - t["log_probs"]).abs().max() < TEACHER_TOL
        assert (own[i, start:end].double() - s["log_probs"]).abs().max() < TEACHER_TOL
        assert (t["log_probs"] - s["log_probs"]).abs().max() > 1e-2  # two different models


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from megatron_rl.trainer.guards.input_guards import InputMismatchError, check_same_tokenizer

    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    teacher = tmp_path / "teacher"
    shutil.copytree(make_tiny_qwen3_moe(tmp_path / "built", seed=2), teacher)
    other = AutoTokenizer.from_pretrained(teacher)
    other.add_special_tokens({"additional_special_tokens": ["<|teacher_only|>"]})
    other.save_pretrained(teacher)
    mine = AutoTokenizer.from_pretrained(student)
    check_same_tokenizer(mine, AutoTokenizer.from_pretrained(student), student, student)  # the same: accepted
    with pytest.raises(InputMismatchError) as err:
        check_same_tokenizer(mine, AutoTokenizer.from_pretrained(teacher), student, teacher)
    message = str(err.value)
    assert f"algo.distill.teacher={teacher}" in message and str(student) in message and "<|teacher_only|>" in message


def _train(out: Path, model: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
               f"model.hf_path={model}", "warmup.sft_steps=0", "trainer.steps=2", "data.eval=null",
               "data.eval_every=0", "trainer.save_every=0", "logging.plot=false", "rollout.prompts_per_step=8",
               "rollout.n_samples=4", "algo.mini_batches_per_step=2", *overrides]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def test_a_teacher_the_actors_layout_cannot_run_is_refused_before_the_build(tmp_path: Path) -> None:
    """A Megatron teacher of another architecture is built in the actor's layout: 3 query groups at parallel.tp=2
    are refused by `check_teacher`, naming the key and the fix; the student's own architecture is not checked again."""
    from transformers import AutoTokenizer

    from megatron_rl.config import load_config
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.trainer.guards.input_guards import InputMismatchError, check_teacher

    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", TinyQwen3MoeSpec(num_attention_heads=6, num_key_value_heads=3),
                                  seed=2)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(student)
    for served, tp in (("megatron", 1), ("local_engine", 2), ("megatron", 2)):
        overrides = [f"model.hf_path={student}", f"parallel.tp={tp}", f"algo.distill.teacher={teacher}",
                     f"algo.distill.served_by={served}"]  # fmt: skip
        cfg = load_config(EXAMPLE, overrides)
        if tp == 1 or served != "megatron":
            check_teacher(cfg, tokenizer, read_hf_config(student))  # accepted
            continue
        with pytest.raises(InputMismatchError) as err:
            check_teacher(cfg, tokenizer, read_hf_config(student))
    message = str(err.value)
    assert f"algo.distill.teacher={teacher}" in message and "num_query_groups=3 is not divisible by tp=2" in message
    assert "algo.distill.served_by=sglang" in message and "\n" not in message


def test_a_megatron_teacher_of_another_size_distils_in_the_loop(tmp_path: Path) -> None:
    """A wider, deeper teacher with fewer experts is a second model resident in the actor's layout: with routing
    replay (R3, the student only) and the top-k term, every step's first update is exactly on-policy and the
    distillation metrics are logged, its reverse KL far from 0."""
    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    spec = TinyQwen3MoeSpec(hidden_size=96, intermediate_size=192, moe_intermediate_size=48, num_hidden_layers=3,
                            num_experts=4)  # fmt: skip
    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", spec, seed=2)
    proc = _train(tmp_path / "run", student, f"algo.distill.teacher={teacher}", "algo.distill.top_k=4",
                  "algo.routing_replay=R3", "algo.replay_check=every_step")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["actor/ppo_kl_first"] == 0.0 and row["distill/reverse_kl"] > 0.1
        assert row["distill/teacher_logp_mean"] < 0 and row["distill/topk_kl"] > 0
        assert row["routing/agreement"] >= 0.0


def test_a_teacher_path_without_a_model_is_refused(tmp_path: Path) -> None:
    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    proc = _train(tmp_path / "run", student, f"algo.distill.teacher={tmp_path / 'nowhere'}")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "is not a Hugging Face model directory (no config.json)" in proc.stderr, proc.stderr[-3000:]


def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl_and_the_task_advantages(tmp_path: Path) -> None:
    """With the student as its own teacher, eq. (1) is exactly 0 on every token (the same weights swapped in score
    the same micro-batches), so the run trains exactly as without distillation: same metrics, bitwise."""
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=1)
    plain = _train(tmp_path / "plain", model)
    taught = _train(tmp_path / "taught", model, f"algo.distill.teacher={model}")
    for proc in (plain, taught):
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("plain", "taught")}  # fmt: skip
    for a, b in zip(rows["plain"], rows["taught"], strict=True):
        assert b["distill/reverse_kl"] == 0.0 and b["distill/teacher_logp_mean"] < 0
        assert b["actor/ppo_kl_first"] == 0.0
        same = [k for k in a if not k.startswith(("time/", "perf/")) and k != "actor/ppo_kl_first_checked"]
        assert {"actor/pg_loss", "actor/grad_norm", "mismatch/logp_abs_diff"} <= set(same)
        assert {k: a[k] for k in same} == {k: b[k] for k in same}


def test_a_local_engine_teacher_of_another_size_scores_the_samples_as_transformers_does(tmp_path: Path) -> None:
    """`served_by: local_engine`: any model the local engine loads (here 3 layers for a 2-layer student) scores
    each sample's tokens in one prefill; the log-probs travel with the samples into the batch's
    `teacher_log_probs` (position t: token t given tokens[:t])."""
    from megatron_rl.rollout.engines.local_engine import LocalEngine
    from megatron_rl.rollout.teacher_scores import add_teacher_log_probs
    from megatron_rl.trainer.step.rl_batch import samples_to_batch

    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", TinyQwen3MoeSpec(num_hidden_layers=3), seed=2)
    rows = make_samples(TinyQwen3MoeSpec().vocab_size, n=4, seed=3)
    samples = as_samples(rows)
    engine = LocalEngine(teacher, device=torch.device("cpu"), weight_version="step-0")
    try:
        add_teacher_log_probs(engine, samples)
    finally:
        engine.shutdown()
    batch = samples_to_batch(samples, advantages=torch.zeros(len(samples)))
    for i, reference in enumerate(hf_score(teacher, rows)):
        start, end = rows[i]["response_start"], len(rows[i]["input_ids"])
        got = batch.fields["teacher_log_probs"][i, start:end].double()
        assert (got - reference["log_probs"]).abs().max() < TEACHER_TOL


def test_a_local_engine_teacher_distils_in_the_loop(tmp_path: Path) -> None:
    """The student as its own local-engine teacher: at the first step the reverse KL is the trainer-vs-transformers
    rounding (fp32, < 1e-4; the teacher keeps the initial weights while the student moves); a teacher of another
    size (3 layers) is accepted and its reverse KL is far from 0."""
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=1)
    bigger = make_tiny_qwen3_moe(tmp_path / "bigger", TinyQwen3MoeSpec(num_hidden_layers=3), seed=2)
    served = "algo.distill.served_by=local_engine"
    for name, teacher in (("self", model), ("bigger", bigger)):
        proc = _train(tmp_path / name, model, f"algo.distill.teacher={teacher}", served)
        assert proc.returncode == 0, proc.stderr[-3000:]
    kl = {name: [json.loads(line)["distill/reverse_kl"] for line in (tmp_path / name / "metrics.jsonl").open()]
          for name in ("self", "bigger")}  # fmt: skip
    assert len(kl["self"]) == 2 and abs(kl["self"][0]) < 1e-4, kl
    assert all(v > 0.1 for v in kl["bigger"]), kl


def test_routing_replay_r3_works_unchanged_on_the_student_with_a_megatron_teacher(tmp_path: Path) -> None:
    """The teacher routes its own tokens; the student replays the engine's routes (R3) in every pass as without
    distillation: replay checks pass, the first update is exactly on-policy, routing metrics are logged."""
    student = make_tiny_qwen3_moe(tmp_path / "student", seed=1)
    teacher = make_tiny_qwen3_moe(tmp_path / "teacher", seed=2)
    proc = _train(tmp_path / "run", student, f"algo.distill.teacher={teacher}", "algo.routing_replay=R3",
                  "algo.replay_check=every_step")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["actor/ppo_kl_first"] == 0.0 and row["distill/reverse_kl"] > 0.1
        assert row["routing/agreement"] >= 0.0


def test_a_batch_without_the_teacher_scores_stops_with_a_message() -> None:
    from megatron_rl.config.algo import DistillConfig
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.trainer.step.old_policy_scores import distill_advantages

    batch = TokenBatch(torch.ones(2, 4, dtype=torch.long), torch.tensor([4, 4]), torch.tensor([1, 1]))
    batch.fields.update(loss_mask=torch.ones(2, 4), old_log_probs=torch.zeros(2, 4), advantages=torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="carry no teacher log-probs"):
        distill_advantages(DistillConfig(teacher="/t", served_by="local_engine"), batch)
