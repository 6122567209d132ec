"""`megatron-rl train` end to end on the tiny MoE: the loop learns, resumes exactly, and rejects bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.tiny_model import make_tiny_qwen3_moe
from tests.dist_harness import run_torchrun
from tests.shared_runs import DEMO_SEED, DEMO_WARMUP, EXAMPLE, TRAIN, WarmedModel

# Deterministic (seeded sampling, CPU): a short version of the embedded demo. Tests about the RL steps start from
# the session's warmed-up model (`warmed_demo`, this warm-up run once) with NO_WARMUP; the warm-up runs in the loop
# where it is the point (the first test, resume).
FAST = [
    *DEMO_WARMUP,
    "optimizer.lr=1e-4",
    "data.eval_prompts=64",
    "logging.wandb=false",
    "logging.plot=true",
]
NO_WARMUP = "warmup.sft_steps=0"
RESUME_DIFFERS = ("time/", "perf/", "sync/", "actor/ppo_kl_first_checked")  # not the same in a resumed run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("demo_model") / "model", seed=DEMO_SEED)


@pytest.fixture(scope="module")
def warmed(warmed_demo: WarmedModel) -> Path:
    return warmed_demo.warmed


def _train(
    out: Path, model: Path, *overrides: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*TRAIN, f"trainer.output_dir={out}", f"model.hf_path={model}", *FAST, *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


LEARN = ("trainer.steps=30", "data.eval_every=30", "data.eval_prompts=256", "trainer.save_every=0")


def _assert_learns(history: list[dict]) -> None:
    """Held-out greedy accuracy rises and the rollout reward does not collapse over the 30 steps.

    A seeded CPU run is exact on one machine, not across CPUs: other kernels round otherwise and the trajectory
    drifts. Measured by `python benchmarks/learning_margins.py --scenario loop --grid full --seeds 1234 1 2 3` and
    `... --seeds 2 3 --kernels avx2 default` (benchmarks/results/learning_margins_20261201.json, docs/testing.md):
    18 healthy runs (seeds 1234, 1, 2, 3 under ATEN_CPU_CAPABILITY=native/avx2/default; 1 or 2 threads run
    alike), 9 broken (GSPO loss sign-flipped, 4 seeds, or zeroed, 5 seeds):
      held-out accuracy rise (256 problems)  healthy 0.031..0.215 (0.031: seed 1 at the ceiling, 0.969 -> 1.0),
                                             broken max 0.000 (zeroed: the weights do not move; sign-flipped -> 0)
      reward, steps 1-10 -> 21-30            healthy +0.003..+0.137, zeroed -0.089..+0.114, sign-flipped
                                             -0.655..-0.250: at 30 steps the rise is within the noise of a
                                             10-step mean, so only a collapse is asserted
    """
    steps = [r for r in history if r["step"] > 0]
    rewards = [r["rollout/reward_mean"] for r in steps]
    early, late = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert late > early - 0.1, f"reward collapsed: {early:.3f} -> {late:.3f}"
    before, after = history[0]["eval/accuracy"], steps[-1]["eval/accuracy"]
    assert after > before + 0.015, f"held-out accuracy did not rise: {before:.3f} -> {after:.3f}"


def test_loop_learns_with_exact_first_update(model_dir: Path, warmed_demo: WarmedModel, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _train(out, model_dir, *LEARN)
    # The output starts with a short header (the full config is in config.yaml) and Megatron's known-harmless
    # fallback warnings are filtered; nothing else warns on this path.
    assert proc.stdout.startswith("megatron-rl train: gspo | 30 steps | new run\n"), proc.stdout[:500]
    assert "full config: config.yaml" in proc.stdout and "\nalgo:\n" not in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    history = _history(out)
    steps = [r for r in history if r["step"] > 0]
    assert len(steps) == 30
    for record in steps:
        assert record["actor/ppo_kl_first"] == 0.0, f"step {record['step']}: first update is not on-policy"
        assert all(v == v and abs(v) != float("inf") for k, v in record.items() if k.startswith("actor/"))
        assert record["mismatch/logp_abs_diff"] < 1e-4  # local engine (fp32 transformers) vs Megatron actor
    _assert_learns(history)
    assert (out / "reward.png").is_file() and (out / "config.yaml").is_file()
    # The warm-up in the loop is the shared warmed-up model the other tests start from, byte for byte.
    assert _files(out / "warmup_model") == _files(warmed_demo.warmed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
def test_loop_learns_from_other_seeds(tmp_path: Path, seed: int) -> None:
    """The same run from another tiny model and data seed (the model seed and trainer.seed)."""
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=seed)
    out = tmp_path / "run"
    _train(out, model, *LEARN, f"trainer.seed={seed}")
    _assert_learns(_history(out))


@pytest.mark.torchrun
def test_resume_matches_uninterrupted_run(model_dir: Path, tmp_path: Path) -> None:
    # With a warm-up in the loop: the resumed run must not redo it.
    common = (
        "trainer.save_every=2",
        "data.eval=null",
        "data.eval_every=0",
        "warmup.sft_steps=20",
        "trainer.keep_last=0",
    )
    whole, split = tmp_path / "whole", tmp_path / "split"
    _train(whole, model_dir, "trainer.steps=4", *common)
    _train(split, model_dir, "trainer.steps=2", *common)
    _train(split, model_dir, "trainer.steps=4", *common)  # resume=auto picks up step 2

    def comparable(out: Path) -> dict[int, dict]:
        return {
            # the resumed start verifies its first sync (rollout.verify_sync, sync/) and checks its first update
            # against a scoring pass (actor/ppo_kl_first_checked); the whole run did neither there
            r["step"]: {k: v for k, v in r.items() if not k.startswith(RESUME_DIFFERS)}
            for r in _history(out)
            if r["step"] > 2
        }

    assert comparable(split) == comparable(whole)
    result = tmp_path / "cmp.json"
    run_torchrun(
        Path(__file__).parent / "scripts" / "compare_checkpoints.py",
        1,
        ["--model", str(model_dir), "--a", str(whole / "checkpoints" / "step_000000004"),
         "--b", str(split / "checkpoints" / "step_000000004"), "--out", str(result)],
    )  # fmt: skip
    verdict = json.loads(result.read_text())
    assert verdict == {"equal": True, "moved_from_initial": True}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.los=gspo"], "algo.los"),
        (["algo.loss=gspoo"], "gspo"),
        (["rollout.n_samples=two"], "rollout.n_samples"),
        (["data.train=/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
    ],
)
def test_bad_input_gives_clear_error(model_dir: Path, tmp_path: Path, overrides: list[str], message: str) -> None:
    proc = _train(tmp_path / "bad", model_dir, "trainer.steps=1", *overrides, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "megatron-rl train: error:" in proc.stderr and message in proc.stderr


def test_tokenizer_that_does_not_match_the_model(model_dir: Path, tmp_path: Path) -> None:
    from megatron_rl.tiny_model import build_char_tokenizer

    big = tmp_path / "big_tokenizer"
    build_char_tokenizer(vocab_size=512).save_pretrained(big)
    proc = _train(tmp_path / "bad", model_dir, "trainer.steps=1", f"model.tokenizer_path={big}", check=False)
    assert proc.returncode == 2
    assert "tokenizer does not match the model" in proc.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.preset=grpo"],
        ["algo.preset=dapo"],
        # The sweep's other points (their losses are unit-tested in tests/algorithms; R2/R3 in the loop at DP=2
        # below): the slow tier, `pytest -m slow tests`.
        pytest.param(["algo.preset=sapo"], id="sapo", marks=pytest.mark.slow),
        pytest.param(["algo.preset=dr_grpo"], id="dr_grpo", marks=pytest.mark.slow),
        pytest.param(["algo.preset=cispo"], id="cispo", marks=pytest.mark.slow),
        pytest.param(["algo.preset=grpo", "algo.routing_replay=R2"], id="grpo+R2", marks=pytest.mark.slow),
        pytest.param(["algo.preset=grpo", "algo.routing_replay=R3"], id="grpo+R3", marks=pytest.mark.slow),
    ],
    ids=lambda o: "+".join(x.split("=")[1] for x in o),
)
def test_algorithms_run_by_override(warmed: Path, tmp_path: Path, overrides: list[str]) -> None:
    out = tmp_path / "run"
    _train(
        out, warmed, "trainer.steps=2", NO_WARMUP, "data.eval=null", "data.eval_every=0",
        "trainer.save_every=0", "logging.plot=false", *overrides,
    )  # fmt: skip
    steps = [r for r in _history(out) if r["step"] > 0]
    assert len(steps) == 2
    trained = [r for r in steps if "actor/ppo_kl_first" in r]
    assert trained, "no step trained"
    for r in trained:
        assert r["actor/ppo_kl_first"] == 0.0
        # Finite; not bounded: a negative-advantage token whose ratio grew has an unclipped PPO gradient (no dual
        # clip), e.g. 4594 in DAPO's second update on one warmed-up model (the same before and after packing);
        # trainer.clip_grad bounds the step.
        assert math.isfinite(r["actor/grad_norm"])
    if "algo.preset=grpo" in overrides and len(overrides) == 1:
        assert all(r["actor/kl_ref"] >= 0.0 for r in trained)  # GRPO keeps a KL-to-reference term


def test_packed_gspo_kernels_train_like_the_reference_loss(warmed: Path, tmp_path: Path) -> None:
    """algo.gspo_kernel=torch and =triton (the Triton interpreter on CPU) in the real loop: same rollouts, same
    losses and gradient norms as the padded reference loss within fp32 summation-order tolerance."""
    common = ["trainer.steps=2", NO_WARMUP, "data.eval=null", "data.eval_every=0", "trainer.save_every=0",
              "logging.plot=false"]  # fmt: skip
    runs = {}
    for kernel in ("reference", "torch", "triton"):
        env = {**os.environ, "TRITON_INTERPRET": "1"} if kernel == "triton" else None
        _train(tmp_path / kernel, warmed, *common, f"algo.gspo_kernel={kernel}", env=env)
        runs[kernel] = [r for r in _history(tmp_path / kernel) if r["step"] > 0]
    ref = runs["reference"]
    assert all("actor/pg_loss" in r for r in ref)
    for kernel in ("torch", "triton"):
        for a, b in zip(ref, runs[kernel], strict=True):
            assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
            assert b["actor/ppo_kl_first"] == 0.0
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/clip_frac_low"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (kernel, key)


@pytest.mark.torchrun
def test_colocated_memory_phases_change_nothing_but_memory(warmed: Path, tmp_path: Path) -> None:
    """trainer.offload_actor + rollout.release_memory: the actor leaves during rollouts, the engine frees (and
    discards) its weights during training and gets them back through the sync; with evaluation and checkpoints
    between steps the run trains exactly like one that keeps everything resident."""
    common = ["trainer.steps=3", NO_WARMUP, "data.eval_every=2", "trainer.save_every=2", "logging.plot=false"]
    _train(tmp_path / "resident", warmed, *common)
    _train(tmp_path / "swapped", warmed, *common, "trainer.offload_actor=true", "rollout.release_memory=true")
    resident, swapped = _history(tmp_path / "resident"), _history(tmp_path / "swapped")
    assert [r["step"] for r in swapped] == [0, 1, 2, 3] and "eval/accuracy" in swapped[2]
    for a, b in zip(resident, swapped, strict=True):
        for key, value in a.items():
            if key.startswith(("mismatch/", "sync/probe_")):  # engine log-probs: same weights bitwise, buffers
                # at other addresses, so fp32 rounding differs by a few 1e-6 (seen: a max |diff| of 4.1e-6 vs 6.9e-6)
                assert b[key] == pytest.approx(value, rel=0.05, abs=1e-5), key
            elif not key.startswith(("time/", "perf/")):
                assert b[key] == value, key
    for record in swapped[1:]:
        assert record["memory/actor_offloaded_gib"] > 0
        assert {"time/actor_offload", "time/actor_reload", "time/engine_release", "time/engine_resume"} <= set(record)
    # Adam's moments exist from the first update on; from then the same training state leaves every step.
    offloaded = [r["memory/actor_offloaded_gib"] for r in swapped[1:]]
    assert offloaded[0] < offloaded[1] == offloaded[2]
    assert "memory/actor_offloaded_gib" not in resident[1]
    result = tmp_path / "cmp.json"
    run_torchrun(
        Path(__file__).parent / "scripts" / "compare_checkpoints.py",
        1,
        ["--model", str(warmed), "--a", str(tmp_path / "resident" / "checkpoints" / "step_000000003"),
         "--b", str(tmp_path / "swapped" / "checkpoints" / "step_000000003"), "--out", str(result)],
    )  # fmt: skip
    assert json.loads(result.read_text()) == {"equal": True, "moved_from_initial": True}


def test_steps_without_samples_checkpoint_and_resume(model_dir: Path, tmp_path: Path) -> None:
    """No warm-up, dynamic sampling with one try: every group of the untrained model is filtered, no update
    runs. The released engine weights are re-sent, the checkpoint of a never-stepped optimizer saves, and a
    resumed run trains from it."""
    run = tmp_path / "run"
    common = ["warmup.sft_steps=0", "trainer.save_every=0", "data.eval=null", "data.eval_every=0",
              "logging.plot=false", "trainer.offload_actor=true", "rollout.release_memory=true"]  # fmt: skip
    _train(run, model_dir, *common, "trainer.steps=2", "algo.dynamic_sampling=true", "algo.max_dynamic_tries=1")
    empty = _history(run)
    assert [r["step"] for r in empty] == [1, 2]
    assert all(r["rollout/filtered_group_frac"] == 1.0 and "actor/pg_loss" not in r for r in empty)
    assert (run / "checkpoints" / "step_000000002" / "COMPLETE").is_file()
    # Another config (dynamic sampling off) continues this run only when the checkpoint is named explicitly.
    refused = _train(run, model_dir, *common, "trainer.steps=3", "algo.dynamic_sampling=false", check=False)
    assert refused.returncode == 2 and "another config: algo.dynamic_sampling" in refused.stderr
    _train(run, model_dir, *common, "trainer.steps=3", "algo.dynamic_sampling=false",
           f"trainer.resume={run / 'checkpoints'}")  # fmt: skip
    resumed = _history(run)[-1]
    assert resumed["step"] == 3 and resumed["actor/ppo_kl_first"] == 0.0  # an update ran from the checkpoint
    assert resumed["actor/grad_norm"] == resumed["actor/grad_norm"]  # finite (0 here: every reward is 0)


def test_memory_release_is_refused_without_a_colocated_partner(model_dir: Path, tmp_path: Path) -> None:
    proc = _train(tmp_path / "bad", model_dir, "trainer.steps=1", "trainer.colocate=false",
                  "rollout.engine=sglang", "rollout.weight_sync=distributed", "rollout.release_memory=true",
                  check=False)  # fmt: skip
    assert proc.returncode == 2
    assert "free memory for a colocated partner" in proc.stderr


@pytest.mark.torchrun
def test_loop_under_torchrun_matches_single_process(warmed: Path, tmp_path: Path) -> None:
    """The same run at TP=2 (+SP) under torchrun: same rollouts, same losses within fp32 tolerance."""
    common = ["trainer.steps=2", NO_WARMUP, "data.eval=null", "data.eval_every=0",
              "trainer.save_every=0", "logging.plot=false", "logging.wandb=false"]  # fmt: skip
    single, tp2 = tmp_path / "single", tmp_path / "tp2"
    _train(single, warmed, *common)
    run_torchrun(
        Path(__file__).parents[2] / "megatron_rl" / "cli.py",
        2,
        ["train", str(EXAMPLE), f"trainer.output_dir={tp2}", f"model.hf_path={warmed}", *FAST, *common,
         "parallel.tp=2"],
        timeout=600,
    )  # fmt: skip
    a, b = _history(single), _history(tp2)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b, strict=True):
        assert ra["rollout/reward_mean"] == rb["rollout/reward_mean"]
        assert ra["actor/ppo_kl_first"] == rb["actor/ppo_kl_first"] == 0.0
        assert abs(ra["actor/pg_loss"] - rb["actor/pg_loss"]) < 1e-5
        # TP=2 (+SP) sums in another order: the grad norms agree within fp32 summation tolerance.
        assert abs(ra["actor/grad_norm"] - rb["actor/grad_norm"]) < 1e-3 * max(1.0, ra["actor/grad_norm"])


@pytest.mark.torchrun
@pytest.mark.parametrize("replay", [pytest.param("R2", marks=pytest.mark.slow), "R3"])  # R2 per rank: tests/routing
def test_routing_replay_at_dp2_keeps_each_ranks_routes_only(warmed: Path, tmp_path: Path, replay: str) -> None:
    """R2/R3 under torchrun at DP=2: each rank's route cache holds only the samples it feeds (half the batch,
    uint8), the first update's ratio is exactly 1 and the losses equal the single-process run's."""
    common = ["trainer.steps=2", NO_WARMUP, "data.eval=null", "data.eval_every=0",
              "trainer.save_every=0", "logging.plot=false", "logging.wandb=false", "algo.preset=grpo",
              f"algo.routing_replay={replay}", "rollout.prompts_per_step=4"]  # fmt: skip
    single, dp2 = tmp_path / "single", tmp_path / "dp2"
    _train(single, warmed, *common)
    run_torchrun(
        Path(__file__).parents[2] / "megatron_rl" / "cli.py",
        2,
        ["train", str(EXAMPLE), f"trainer.output_dir={dp2}", f"model.hf_path={warmed}", *FAST, *common],
        timeout=600,
    )
    a, b = _history(single), _history(dp2)
    for ra, rb in zip(a, b, strict=True):
        batch = 4 * 8  # prompts_per_step x n_samples
        assert ra["routing/cache_samples"] == batch and rb["routing/cache_samples"] == batch // 2
        assert rb["routing/cache_mib"] < ra["routing/cache_mib"]
        assert ra["actor/ppo_kl_first"] == rb["actor/ppo_kl_first"] == 0.0
        assert ra["rollout/reward_mean"] == rb["rollout/reward_mean"]
        assert abs(ra["actor/pg_loss"] - rb["actor/pg_loss"]) < 1e-5
        assert rb["routing/agreement"] > 0.9


@pytest.mark.torchrun
def test_logprobs_from_training_checkpoint_in_other_layouts(warmed_demo: WarmedModel, tmp_path: Path) -> None:
    """`megatron-rl logprobs --checkpoint` scores a checkpoint `train` wrote (the shared warm-up run's), at TP=1
    and TP=2 alike."""
    from tests.hf_reference import make_samples

    out = warmed_demo.run
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(s) + "\n" for s in make_samples(vocab=128, n=3)))
    scored = {}
    for name, extra in {"tp1": [], "tp2": ["--tp", "2"]}.items():
        dest = tmp_path / f"{name}.jsonl"
        args = ["logprobs", "--checkpoint", str(out / "checkpoints"), "--input", str(inp), "--output", str(dest)]
        run_torchrun(Path(__file__).parents[2] / "megatron_rl" / "cli.py", 1 if name == "tp1" else 2, args + extra)
        scored[name] = [json.loads(line) for line in dest.read_text().splitlines()]
    initial = tmp_path / "initial.jsonl"
    subprocess.run([sys.executable, "-m", "megatron_rl.cli", "logprobs", "--hf-model", str(warmed_demo.initial),
                    "--input", str(inp), "--output", str(initial)], check=True, capture_output=True,
                   timeout=300)  # fmt: skip
    base = [json.loads(line) for line in initial.read_text().splitlines()]
    for a, b, c in zip(scored["tp1"], scored["tp2"], base, strict=True):
        assert max(abs(x - y) for x, y in zip(a["log_probs"], b["log_probs"], strict=True)) < 5e-6
        assert a["routed_experts"] == b["routed_experts"]
        assert max(abs(x - y) for x, y in zip(a["log_probs"], c["log_probs"], strict=True)) > 1e-3  # trained
