"""Bad inputs end in one line that names the file (and line) and the fix, exit code 2, no traceback.

Real files throughout: a checkpoint saved by a one-step `megatron-rl train` run of the tiny MoE (damaged in
copies), the tiny model's own safetensors file truncated, JSONL files with a bad line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.megatron_backend.checkpoint.dist_checkpoint_files import expected_file_sizes

REPO = Path(__file__).parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe_gspo.yaml"
STEP = "step_000000001"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """Run `megatron-rl ARGV` in this process: (exit code, the error line on stderr)."""
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megatron-rl ")]
    assert "Traceback" not in err
    return code, lines[-1] if lines else err


def _train(out: Path, model: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`megatron-rl train` of the tiny MoE into `out`: a step is two prompts x two samples, a checkpoint each step."""
    args = [f"trainer.output_dir={out}", f"model.hf_path={model}", "trainer.save_every=1", "warmup.sft_steps=0",
            "data.eval=null", "data.eval_every=0", "rollout.prompts_per_step=2", "rollout.n_samples=2",
            "algo.mini_batches_per_step=1", "logging.wandb=false", "logging.plot=false", *overrides]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), *args],
                          capture_output=True, text=True, timeout=900)  # fmt: skip


@pytest.fixture(scope="session")
def run_dir(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real one-step training run of the tiny MoE that saved a checkpoint (model + optimizer + RNG)."""
    out = tmp_path_factory.mktemp("bad_inputs") / "run"
    proc = _train(out, tiny_moe_dir, "trainer.steps=1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (out / "checkpoints" / STEP / "COMPLETE").is_file()
    return out


@pytest.fixture
def run_copy(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run (to damage) with its checkpoint directory."""
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture(scope="session")
def samples_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("samples") / "in.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "response_start": 2}) + "\n")
    return path


def _distcp(checkpoint: Path) -> Path:
    return sorted((checkpoint / "megatron").glob("*.distcp"))[-1]


def _load_argv(command: str, checkpoint: Path, samples_file: Path, tmp_path: Path) -> list[str]:
    """The arguments of a command that loads `checkpoint`: `logprobs --checkpoint` or `convert megatron-to-hf`."""
    if command == "logprobs":
        inputs = ["--input", str(samples_file), "--output", str(tmp_path / "o")]
        return ["logprobs", "--checkpoint", str(checkpoint), *inputs]
    return ["convert", "megatron-to-hf", str(checkpoint), str(tmp_path / "hf")]


# ---------------------------------------------------------------------------------------------- dist checkpoints
@pytest.mark.parametrize("command", ["logprobs", "convert"])
def test_deleted_distcp_file_is_named_with_the_older_checkpoint(
    command: str, run_copy: Path, samples_file: Path, tmp_path: Path, capsys
) -> None:
    ckpts = run_copy / "checkpoints"
    shutil.copytree(ckpts / STEP, ckpts / "step_000000000")  # an older complete checkpoint to fall back to
    damaged = ckpts / STEP
    file = _distcp(damaged)
    file.unlink()
    code, line = _cli(capsys, *_load_argv(command, damaged, samples_file, tmp_path))
    assert code == 2
    assert line == (
        f"megatron-rl {command}: error: checkpoint {damaged} is damaged: megatron/{file.name} is missing (listed in "
        f"megatron/.metadata); resume from an older checkpoint (trainer.resume={ckpts / 'step_000000000'}) or "
        "re-save it"
    )


def test_resume_names_a_damaged_checkpoint_before_the_model_is_built(run_copy: Path, tiny_moe_dir: Path) -> None:
    damaged = run_copy / "checkpoints" / STEP
    file = _distcp(damaged)
    file.unlink()
    proc = _train(run_copy, tiny_moe_dir, "trainer.steps=2")  # resume=auto: continue the one-step run
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"megatron-rl train: error: checkpoint {damaged} is damaged: megatron/{file.name} is missing (listed in "
        "megatron/.metadata); re-save it (no older complete checkpoint is next to it to resume from)"
    )
    assert "megatron-rl train: gspo" not in proc.stdout  # the run header is printed once the model is built


@pytest.mark.parametrize("command", ["logprobs", "convert"])
def test_truncated_distcp_file_is_named(command: str, run_copy: Path, samples_file: Path, tmp_path: Path, capsys):
    damaged = run_copy / "checkpoints" / STEP
    file = _distcp(damaged)
    needed = expected_file_sizes(damaged / "megatron")[file.name]
    with file.open("r+b") as f:
        f.truncate(needed // 2)
    # convert is given the checkpoints folder: the damaged checkpoint is found as its latest
    source = damaged if command == "logprobs" else run_copy / "checkpoints"
    code, line = _cli(capsys, *_load_argv(command, source, samples_file, tmp_path))
    assert code == 2
    assert line == (
        f"megatron-rl {command}: error: checkpoint {damaged} is damaged: megatron/{file.name} is truncated/corrupt "
        f"(megatron/.metadata says it holds at least {needed} bytes, the file has {needed // 2}); re-save it (no "
        "older complete checkpoint is next to it to resume from)"
    )


@pytest.mark.parametrize(
    ("command", "name"),
    [("logprobs", "trainer_state.json"), ("logprobs", "hf_config.json"), ("convert", "hf_config.json")],
)
def test_corrupt_json_state_is_named(
    command: str, name: str, run_copy: Path, samples_file: Path, tmp_path: Path, capsys
) -> None:
    damaged = run_copy / "checkpoints" / STEP
    (damaged / name).write_text('{"step": 1, ')  # cut short while being written by hand
    code, line = _cli(capsys, *_load_argv(command, damaged, samples_file, tmp_path))
    assert code == 2
    assert line == (
        f"megatron-rl {command}: error: checkpoint {damaged} is damaged: {name} is not valid JSON (Expecting "
        "property name enclosed in double quotes: line 1 column 13 (char 12)); re-save it (no older complete "
        "checkpoint is next to it to resume from)"
    )


def test_architecture_mismatch_keeps_its_own_message(run_copy: Path, tiny_moe_dir: Path, tmp_path: Path, capsys):
    other = tmp_path / "top4"
    shutil.copytree(tiny_moe_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 4}))
    damaged = run_copy / "checkpoints" / STEP
    code, line = _cli(capsys, "convert", "megatron-to-hf", str(damaged), str(tmp_path / "hf"), "--expect-config",
                      str(other))  # fmt: skip
    assert code == 2
    assert line == (
        f"megatron-rl convert: error: {damaged}: holds a model with num_experts_per_tok=2 but the model was built "
        "with num_experts_per_tok=4: it is a checkpoint of another architecture"
    )


# ---------------------------------------------------------------------------------------------- conversion
def test_training_checkpoint_exports_the_runs_tokenizer(run_dir: Path, tiny_moe_dir: Path, tmp_path: Path, capsys):
    """No --hf-extras: the tokenizer and generation config come from model.hf_path of the run's config.yaml."""
    code = main(["convert", "megatron-to-hf", str(run_dir / "checkpoints"), str(tmp_path / "hf")])
    assert code == 0 and "warning" not in capsys.readouterr().err
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tiny_moe_dir / name).read_bytes(), name


def test_training_checkpoint_without_its_run_config_says_what_is_missing(
    run_copy: Path, tiny_moe_dir: Path, tmp_path: Path, capsys
) -> None:
    (run_copy / "config.yaml").unlink()
    ckpt, out = run_copy / "checkpoints" / STEP, tmp_path / "hf"
    code = main(["convert", "megatron-to-hf", str(ckpt), str(out)])
    err = capsys.readouterr().err.splitlines()
    assert code == 0 and (out / "model.safetensors.index.json").is_file()  # the weights are still written
    searched = f"{ckpt / 'hf'}; {run_copy / 'config.yaml'} (missing or unreadable)"
    assert err == [
        f"megatron-rl convert: warning: {out} has no tokenizer: none of tokenizer.json, tokenizer_config.json, "
        f"special_tokens_map.json, chat_template.jinja, vocab.json, merges.txt, tokenizer.model found in {searched}; "
        "add them with --hf-extras /path/to/hf_model (the model the checkpoint was trained from)",
        f"megatron-rl convert: warning: {out}/generation_config.json holds only config.json's bos/eos/pad token ids: "
        f"none found in {searched}; add the model's own with --hf-extras /path/to/hf_model",
    ]
    assert not (out / "tokenizer.json").exists()
    code = main(["convert", "megatron-to-hf", str(ckpt), str(tmp_path / "hf2"), "--hf-extras", str(tiny_moe_dir)])
    assert code == 0 and "warning" not in capsys.readouterr().err
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        assert (tmp_path / "hf2" / name).read_bytes() == (tiny_moe_dir / name).read_bytes(), name


def test_training_checkpoint_with_relative_model_path_converts_from_anywhere(
    run_dir: Path, tiny_moe_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """config.yaml's relative model.hf_path starts where the run started (found from its trainer.output_dir)."""
    work = tmp_path / "work"
    shutil.copytree(run_dir, work / "runs" / "r")
    shutil.copytree(tiny_moe_dir, work / "models" / "m")
    config = work / "runs" / "r" / "config.yaml"
    config.write_text(config.read_text().replace(str(tiny_moe_dir), "models/m").replace(str(run_dir), "runs/r"))
    monkeypatch.chdir(tmp_path)  # not the directory the run started in
    ckpts = work / "runs" / "r" / "checkpoints"
    assert main(["convert", "megatron-to-hf", str(ckpts), str(tmp_path / "hf")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tiny_moe_dir / "tokenizer.json").read_bytes()
    shutil.rmtree(work / "models")
    assert main(["convert", "megatron-to-hf", str(ckpts), str(tmp_path / "hf2")]) == 0
    searched = f"{ckpts / STEP / 'hf'}; model.tokenizer_path=models/m of {config} (not found)"
    assert capsys.readouterr().err.splitlines()[0] == (
        f"megatron-rl convert: warning: {tmp_path / 'hf2'} has no tokenizer: none of tokenizer.json, "
        "tokenizer_config.json, special_tokens_map.json, chat_template.jinja, vocab.json, merges.txt, tokenizer.model "
        f"found in {searched}; add them with --hf-extras /path/to/hf_model (the model the checkpoint was trained from)"
    )


def test_truncated_safetensors_file_is_named(tiny_moe_dir: Path, tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_moe_dir, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 1000)
    code, line = _cli(capsys, "convert", "hf-to-megatron", str(model), str(tmp_path / "out"))
    assert code == 2
    assert line == (
        f"megatron-rl convert: error: {weights} is truncated or corrupt (safetensors header says {size} bytes, file "
        f"has {size - 1000}): re-download it"
    )
    assert not (tmp_path / "out").exists()


def test_missing_shard_is_named(tiny_moe_dir: Path, tmp_path: Path, capsys) -> None:
    from safetensors import safe_open

    model = tmp_path / "model"
    shutil.copytree(tiny_moe_dir, model)
    with safe_open(model / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    code, line = _cli(capsys, "convert", "hf-to-megatron", str(model), str(tmp_path / "out"))
    assert code == 2
    assert line == (
        f"megatron-rl convert: error: {model}: shard model-00002-of-00002.safetensors is missing "
        f"(model.safetensors.index.json places {len(names) // 2} tensors in it): re-download it"
    )


def test_convert_of_an_empty_folder_names_convert_s_own_arguments(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    code, line = _cli(capsys, "convert", "hf-to-megatron", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert code == 2
    assert line == (
        f"megatron-rl convert: error: {tmp_path / 'empty' / 'config.json'} not found: HF_DIR of `megatron-rl convert "
        "hf-to-megatron HF_DIR OUT_DIR` must be a Hugging Face model directory (config.json + *.safetensors)"
    )
    code, line = _cli(capsys, "convert", "megatron-to-hf", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert code == 2 and "--hf-model" not in line
    assert line == (
        f"megatron-rl convert: error: no complete checkpoint at {tmp_path / 'empty'} (a checkpoint directory holds "
        "COMPLETE, hf_config.json and megatron/)"
    )


# ---------------------------------------------------------------------------------------------- JSONL inputs
def test_malformed_logprobs_input_line_names_file_and_line(tiny_moe_dir: Path, tmp_path: Path, capsys) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3], "response_start": 1}\n\n{"input_ids": [1, 2\n')
    code, line = _cli(capsys, "logprobs", "--hf-model", str(tiny_moe_dir), "--input", str(inp), "--output",
                      str(tmp_path / "out.jsonl"))  # fmt: skip
    assert code == 2
    assert line == f"megatron-rl logprobs: error: {inp}:3: not valid JSON (Expecting ',' delimiter at column 20)"


def test_prompt_file_errors_name_file_and_line(tmp_path: Path) -> None:
    from megatron_rl.jsonl import JsonlError
    from megatron_rl.rollout.prompts import load_prompts

    def tokenizer(text: str, add_special_tokens: bool) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n')
    with pytest.raises(JsonlError) as err:
        load_prompts(prompts, tokenizer)
    assert str(err.value) == f"{prompts}:2: missing key 'prompt' (has ['answer', 'question'])"
    prompts.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff"}\n')
    with pytest.raises(JsonlError, match=rf"^{prompts}:2: not valid UTF-8 \("):
        load_prompts(prompts, tokenizer)


# ---------------------------------------------------------------------------------------------- config paths
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.hf_path=/nonexistent/model", "model.hf_path='/nonexistent/model' does not exist: point it at a "
         "Hugging Face model directory (config.json, *.safetensors, tokenizer), or set model.build_tiny_if_missing="
         "true to build the tiny demo model there"),
        ("model.hf_path={tmp}", "model.hf_path='{tmp}' has no config.json: it must be a Hugging Face model directory "
         "(config.json, *.safetensors, tokenizer)"),
        ("model.tokenizer_path=/nonexistent/tok", "model.tokenizer_path='/nonexistent/tok' is not a directory: set it "
         "to the tokenizer's directory (tokenizer.json, tokenizer_config.json) or to null to use model.hf_path's"),
        ("data.train=/nonexistent/train.jsonl", "data.train='/nonexistent/train.jsonl': no such file or folder; give "
         "a JSONL / Parquet / .arrow file or a `datasets` folder, or a built-in task ('synthetic', 'synthetic_tool')"),
        ("data.eval={tmp}/eval.jsonl", "data.eval='{tmp}/eval.jsonl': no such file or folder; give a JSONL / Parquet "
         "/ .arrow file or a `datasets` folder, or a built-in task ('synthetic', 'synthetic_tool')"),
    ],
)  # fmt: skip
def test_config_paths_are_checked_before_anything_is_built(
    override: str, message: str, tiny_moe_dir: Path, tmp_path: Path, capsys
) -> None:
    argv = ["train", str(EXAMPLE), f"model.hf_path={tiny_moe_dir}", "model.build_tiny_if_missing=false",
            f"trainer.output_dir={tmp_path / 'run'}", override.format(tmp=tmp_path)]  # fmt: skip
    code, line = _cli(capsys, *argv)
    assert code == 2
    assert line == f"megatron-rl train: error: {message.format(tmp=tmp_path)}"
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- the CLI itself
def test_closed_pipe_is_silent() -> None:
    """`megatron-rl train --help-config | head`: the reader goes away before we write; exit 0, nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", "--help-config"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""


def test_help_documents_the_traceback_switch(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--traceback, --debug" in capsys.readouterr().out


def test_truncated_rng_state_is_named(run_copy: Path, samples_file: Path, tmp_path: Path, capsys) -> None:
    damaged = run_copy / "checkpoints" / STEP
    rng = damaged / "rng" / "rank_00000.pt"
    with rng.open("r+b") as f:
        f.truncate(100)
    code, line = _cli(capsys, "logprobs", "--checkpoint", str(damaged), "--input", str(samples_file), "--output",
                      str(tmp_path / "o"))  # fmt: skip
    assert code == 2
    assert line.startswith(
        f"megatron-rl logprobs: error: checkpoint {damaged} is damaged: rng/rank_00000.pt is truncated/corrupt ("
    )
    assert line.endswith("); re-save it (no older complete checkpoint is next to it to resume from)")


# ---------------------------------------------------------------------------------------------- input guards
def _model_copy(tiny_moe_dir: Path, tmp_path: Path, **files: dict) -> Path:
    """A copy of the tiny model whose JSON files named in `files` (config, generation_config, tokenizer_config)
    are updated with the given keys."""
    model = tmp_path / "model"
    shutil.copytree(tiny_moe_dir, model)
    for name, changes in files.items():
        path = model / f"{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return model


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_tokenizer_guard_accepts_the_models_own_and_a_smaller_one(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """The tiny model's tokenizer: 128 tokens, eos 2 (<|im_end|>), pad 3, no bos, as config.json and
    generation_config.json say; a padded vocabulary above the tokenizer's size is normal, and an eos list in
    generation_config.json that holds the tokenizer's eos agrees."""
    from megatron_rl.trainer.guards.input_guards import check_tokenizer

    model = _model_copy(tiny_moe_dir, tmp_path, generation_config={"eos_token_id": [2, 0]})
    tokenizer = _tokenizer(model)
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (128, 2, 3, None)
    check_tokenizer(tokenizer, model, model, 128)
    check_tokenizer(tokenizer, model, model, 160)  # as Qwen3: 151,669 tokens, 151,936 rows


@pytest.mark.parametrize(
    ("files", "vocab", "message"),
    [
        ({}, 100, "tokenizer at {m} has 128 tokens but the model's vocabulary has 100: the tokenizer does not match "
         "the model (set model.tokenizer_path to the model's own tokenizer)"),
        ({"tokenizer_config": {"eos_token": "<|endoftext|>"}}, 128, "tokenizer at {m} has eos_token_id=0 but "
         "{m}/config.json says eos_token_id=2: the tokenizer does not match the model (set model.tokenizer_path to the "
         "model's own tokenizer, or correct config.json)"),
        ({"generation_config": {"eos_token_id": [5, 6]}}, 128, "tokenizer at {m} has eos_token_id=2 but "
         "{m}/generation_config.json says eos_token_id=[5, 6]: the tokenizer does not match the model (set "
         "model.tokenizer_path to the model's own tokenizer, or correct generation_config.json)"),
        ({"config": {"pad_token_id": 0}}, 128, "tokenizer at {m} has pad_token_id=3 but {m}/config.json says "
         "pad_token_id=0: the tokenizer does not match the model (set model.tokenizer_path to the model's own "
         "tokenizer, or correct config.json)"),
        ({"tokenizer_config": {"bos_token": "<|im_start|>"}, "config": {"bos_token_id": 0}}, 128, "tokenizer at {m} "
         "has bos_token_id=1 but {m}/config.json says bos_token_id=0: the tokenizer does not match the model (set "
         "model.tokenizer_path to the model's own tokenizer, or correct config.json)"),
    ],
    ids=["larger", "eos", "eos-list", "pad", "bos"],
)  # fmt: skip
def test_tokenizer_guard_refuses_another_models_tokenizer(
    files: dict, vocab: int, message: str, tiny_moe_dir: Path, tmp_path: Path
) -> None:
    from megatron_rl.trainer.guards.input_guards import InputMismatchError, check_tokenizer

    model = _model_copy(tiny_moe_dir, tmp_path, **files)
    with pytest.raises(InputMismatchError) as err:
        check_tokenizer(_tokenizer(model), model, model, vocab)
    assert str(err.value) == message.format(m=model)


def test_max_positions_follows_yarn(tiny_moe_dir: Path) -> None:
    """max_position_embeddings (256) unless rope_scaling is YaRN: then original_max_position_embeddings * factor."""
    from megatron_rl.models.architecture import max_positions

    config = json.loads((tiny_moe_dir / "config.json").read_text())
    assert max_positions(config) == 256
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    assert max_positions({**config, "rope_scaling": yarn}) == 512
    assert max_positions({**config, "rope_scaling": {"type": "yarn", "factor": 2.0}}) == 512  # original = 256
    assert max_positions({**config, "rope_scaling": {"type": "linear", "factor": 2.0}}) == 256
    deepseek = json.loads((REPO / "examples" / "hf_configs" / "deepseek_v3.json").read_text())
    assert max_positions(deepseek) == 4096 * 40


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.tokenizer_path={tok}",), "tokenizer at {tok} has eos_token_id=0 but {m}/config.json says "
         "eos_token_id=2: the tokenizer does not match the model (set model.tokenizer_path to the model's own "
         "tokenizer, or correct config.json)"),
        (("rollout.sampling.max_new_tokens=300", "trainer.micro_batch_tokens=4096"), "rollout.sampling."
         "max_new_tokens=300 is 300 tokens, more than the model's 256 positions: use a lower "
         "rollout.sampling.max_new_tokens (at most 256)"),
    ],
    ids=["tokenizer", "positions"],
)  # fmt: skip
def test_guards_refuse_before_the_model_is_built(
    overrides: tuple[str, ...], message: str, tiny_moe_dir: Path, tmp_path: Path
) -> None:
    """`megatron-rl train` ends in the guard's one line, exit 2, before the run header (printed once the model is
    built)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_moe_dir / name, tok / name)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    proc = _train(tmp_path / "run", tiny_moe_dir, *(o.format(tok=tok) for o in overrides))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "megatron-rl train: error: " + message.format(tok=tok, m=tiny_moe_dir)
    assert "megatron-rl train: gspo" not in proc.stdout


def test_positions_guard_names_the_longest_prompt(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """A JSONL prompt file whose longest prompt (line 2) plus max_new_tokens passes the model's 256 positions."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.guards.input_guards import InputMismatchError, check_positions
    from megatron_rl.trainer.rollout_phase import prompt_data

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "1 2", "answer": "2 1"}, {"prompt": "7" * 150, "answer": "7"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(EXAMPLE, [f"model.hf_path={tiny_moe_dir}", f"data.train={prompts}", "data.eval=null",
                                "data.eval_every=0", "data.reward=exact_match", "warmup.sft_steps=0",
                                "rollout.sampling.max_new_tokens=128"])  # fmt: skip
    data = prompt_data(cfg, _tokenizer(tiny_moe_dir))
    length, where = data.longest_prompt()
    assert 150 <= length < 200 and where == f"{prompts}:2"
    with pytest.raises(InputMismatchError) as err:
        check_positions(cfg, data, 256)
    assert str(err.value) == (
        f"the longest prompt ({length} tokens, {where}) plus rollout.sampling.max_new_tokens=128 is {length + 128} "
        f"tokens, more than the model's 256 positions: use shorter prompts or a lower rollout.sampling."
        f"max_new_tokens (at most {256 - length})"
    )
    check_positions(cfg, data, length + 128)  # exactly fits
    with pytest.raises(InputMismatchError, match=r"positions: use prompts shorter than 128 tokens$"):
        check_positions(cfg, data, 128)


def test_multi_turn_positions_are_bounded_by_turns_max_tokens(tiny_moe_dir: Path) -> None:
    from megatron_rl.config import load_config
    from megatron_rl.trainer.guards.input_guards import InputMismatchError, check_positions

    tool_example = REPO / "examples" / "tiny_moe_tool_gspo.yaml"
    cfg = load_config(tool_example, [f"model.hf_path={tiny_moe_dir}", "rollout.turns.max_tokens=300"])
    with pytest.raises(InputMismatchError) as err:
        check_positions(cfg, None, 256)
    assert str(err.value) == (
        "rollout.turns.max_tokens=300 (a whole trajectory, prompt included) exceeds the model's 256 positions: "
        "lower rollout.turns.max_tokens to at most 256"
    )
    check_positions(load_config(tool_example, [f"model.hf_path={tiny_moe_dir}"]), None, 256)


def test_missing_optional_dependency_names_the_extra() -> None:
    """With pyarrow / math-verify / sglang not importable, `require` says which extra to install, in one line."""
    check = (
        "import sys\n"
        "for m in ('pyarrow', 'math_verify', 'sglang'): sys.modules[m] = None\n"
        "from megatron_rl.optional_deps import MissingOptionalDependency, require\n"
        "for m in ('pyarrow.parquet', 'math_verify', 'sglang'):\n"
        "    try:\n"
        "        require(m)\n"
        "    except MissingOptionalDependency as err:\n"
        "        print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    assert lines[0].startswith("'pyarrow.parquet' is required for Parquet, Arrow and `datasets`-folder prompt files")
    assert lines[0].endswith("; install it with: pip install 'megatron-rl[data]'")
    assert lines[1].endswith("; install it with: pip install 'megatron-rl[math]'")
    assert lines[2].endswith("; install it with: pip install 'megatron-rl[sglang]'")


def test_train_without_math_verify_names_the_extra(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """data.reward=math with math-verify not importable: one line naming `megatron-rl[math]`, exit 2, before the
    model is built."""
    argv = ["train", str(EXAMPLE), f"model.hf_path={tiny_moe_dir}", f"trainer.output_dir={tmp_path / 'run'}",
            "data.reward=math", "warmup.sft_steps=0", "data.eval=null", "data.eval_every=0",
            "logging.wandb=false"]  # fmt: skip
    script = "import sys; sys.modules['math_verify'] = None\nfrom megatron_rl.cli import main\n"
    script += f"sys.exit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-rl train: error: 'math_verify' is required for the math, dapo and auto rewards")
    assert last.endswith("; install it with: pip install 'megatron-rl[math]'")
    assert "megatron-rl train: gspo" not in proc.stdout
