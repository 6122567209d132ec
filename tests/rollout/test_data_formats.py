"""The data formats people bring (verl parquet, slime JSONL, TRL chat JSONL, `datasets` folders, Arrow files and
folders of shards): rows, nested keys, metadata, refusals, the weighted mixture, and 2-step training runs on each.

The fixtures are in tests/fixtures/data (written by its make_fixtures.py); `datasets` 5.2.0's `save_to_disk` of the
same rows writes the same three files and reads back as the same rows (checked once by hand, 2026-12-01).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import load_config
from megatron_rl.data.mixture import Mixture
from megatron_rl.data.readers import DataFileError, read_rows
from megatron_rl.rollout.prompts import Prompt, PromptIterator, load_prompts
from megatron_rl.tiny_model import build_char_tokenizer
from megatron_rl.trainer.rollout_phase import prompt_data
from tests.fixtures.data import make_fixtures

FIXTURES = Path(__file__).parents[1] / "fixtures" / "data"
ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "tiny_moe_gspo.yaml"


def _chat(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------------------------- the layouts
def test_verl_parquet_nested_answer_and_metadata(tokenizer):
    prompts = load_prompts(
        FIXTURES / "verl.parquet", tokenizer, answer_key="reward_model.ground_truth", apply_chat_template=True
    )
    assert len(prompts) == 8
    first = prompts[0]
    assert first.text == _chat(tokenizer, _user("1+1=")) and first.answer == "2"
    assert first.token_ids == tokenizer(first.text, add_special_tokens=False)["input_ids"]
    # Every other column reaches the reward's metadata as it is: nested dicts stay dicts, ints stay ints; the
    # prompt's messages are kept for TRL-style rewards (they get chat prompts as message lists).
    assert first.metadata == {
        "prompt_messages": _user("1+1="),
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 0, "answer": "1+1=2\n#### 2", "question": "1+1"},
    }
    assert prompts[7].answer == "6" and prompts[7].metadata["extra_info"]["index"] == 7
    assert first.origin == f"{FIXTURES / 'verl.parquet'} row 1"


def test_slime_jsonl_text_and_messages(tokenizer):
    prompts = load_prompts(FIXTURES / "slime.jsonl", tokenizer, answer_key="label", apply_chat_template=True)
    assert [p.answer for p in prompts] == [str(a * b) for a, b in make_fixtures.SUMS]
    assert prompts[0].text == _chat(tokenizer, _user("1*1=")) and prompts[0].metadata == {"metadata": {"id": 0}}
    system = [{"role": "system", "content": "Be short."}, *_user("4*2=")]
    assert prompts[7].text == _chat(tokenizer, system) and prompts[7].origin.endswith("slime.jsonl:8")


def test_trl_chat_prompts_and_messages_column(tokenizer):
    prompts = load_prompts(FIXTURES / "trl_chat.jsonl", tokenizer, answer_key="solution", apply_chat_template=True)
    assert prompts[0].text == _chat(tokenizer, _user("1-1=")) and prompts[0].answer == "0"
    # A `messages` row (no prompt column) is prompted up to its last user turn: the assistant's reply is not shown.
    assert prompts[7].text == _chat(tokenizer, _user("9-4=")) and prompts[7].answer == "5"
    assert prompts[7].metadata == {"prompt_messages": _user("9-4=")}
    assert prompts[0].metadata == {"prompt_messages": _user("1-1=")}


def test_saved_dataset_folder_and_arrow_file(tokenizer, tmp_path: Path):
    folder = load_prompts(FIXTURES / "hf_dataset", tokenizer, prompt_key="question", apply_chat_template=True)
    assert [p.answer for p in folder][:2] == ["1+1=2\n#### 2", "2+1=3\n#### 3"]
    assert folder[1].text == _chat(tokenizer, _user("2+1=")) and folder[1].metadata == {}
    assert folder[1].origin == f"{FIXTURES / 'hf_dataset' / 'data-00000-of-00001.arrow'} row 2"
    arrow = load_prompts(FIXTURES / "prompts.arrow", tokenizer)  # IPC file format
    assert [(p.text, p.answer) for p in arrow][:2] == [("11", "11"), ("12", "21")]
    assert arrow[0].metadata == {"data_source": "rev"}
    # The same rows as an IPC stream (datasets' cache files), as JSON lines and as a JSON list: the same rows.
    rows = [r for _, r in read_rows(FIXTURES / "prompts.arrow")]
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "l.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=1))
    for name in ("s.arrow", "l.json", "a.json"):
        assert [r for _, r in read_rows(tmp_path / name)] == rows, name
    assert [w for w, _ in read_rows(tmp_path / "a.json")][1] == f"{tmp_path / 'a.json'} row 2"


def test_folder_of_shards_and_split_refusals(tmp_path: Path):
    data = tmp_path / "hub" / "data"
    data.mkdir(parents=True)
    for i in range(2):
        shard = pa.Table.from_pylist([{"prompt": f"p{i}{j}"} for j in range(3)])
        pq.write_table(shard, data / f"train-0000{i}-of-00002.parquet")
    (tmp_path / "hub" / "README.md").write_text("---\nconfigs: ...\n---\n")  # a Hub snapshot's other files
    (tmp_path / "hub" / "dataset_infos.json").write_text("{}")
    (tmp_path / "hub" / ".cache").mkdir()
    (tmp_path / "hub" / ".cache" / "x.json").write_text("{}")
    assert [r["prompt"] for _, r in read_rows(tmp_path / "hub")] == ["p00", "p01", "p02", "p10", "p11", "p12"]
    pq.write_table(pa.Table.from_pylist([{"prompt": "t"}]), data / "test-00000-of-00001.parquet")
    with pytest.raises(DataFileError, match=r"several splits: data/test \(1 file\), data/train \(2 files\); .*"
                       r"e\.g\. data\.train=.*test-00000-of-00001\.parquet"):  # fmt: skip
        list(read_rows(tmp_path / "hub"))
    verl = tmp_path / "gsm8k"  # verl's preprocessing writes train.parquet and test.parquet side by side
    verl.mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([{"prompt": split}]), verl / f"{split}.parquet")
    with pytest.raises(DataFileError, match=r"several splits: test \(1 file\), train \(1 file\)"):
        list(read_rows(verl))
    splits = tmp_path / "dd"  # DatasetDict.save_to_disk: dataset_dict.json and a folder per split
    for split in ("train", "test"):
        make_fixtures.write_saved_dataset(splits / split, [{"prompt": split}])
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(DataFileError) as err:
        list(read_rows(splits))
    assert str(err.value) == (
        f"{splits} is a DatasetDict with the splits 'train', 'test': name one split's folder, e.g. "
        f"data.train={splits / 'train'}"
    )
    assert [r for _, r in read_rows(splits / "test")] == [{"prompt": "test"}]


def test_bad_files_are_named(tmp_path: Path, tokenizer):
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(DataFileError, match=r"p\.csv: unknown data format '\.csv'; give a \.jsonl, \.json, "):
        load_prompts(tmp_path / "p.csv", tokenizer)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataFileError, match=r"bad\.parquet: not a readable Parquet file"):
        load_prompts(tmp_path / "bad.parquet", tokenizer)
    (tmp_path / "bad.arrow").write_bytes(b"\x00" * 16)
    with pytest.raises(DataFileError, match=r"bad\.arrow: not an Arrow IPC stream or file"):
        load_prompts(tmp_path / "bad.arrow", tokenizer)
    (tmp_path / "obj.json").write_text('{\n  "prompt": "x"\n}\n')
    with pytest.raises(ValueError, match=r"obj\.json:1: not valid JSON .*read as JSON lines or a JSON list"):
        load_prompts(tmp_path / "obj.json", tokenizer)
    saved = tmp_path / "saved"
    make_fixtures.write_saved_dataset(saved, [{"prompt": "x", "answer": "y"}])
    (saved / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(DataFileError, match=r"the shard data-00000-of-00001\.arrow that state\.json lists is missing"):
        load_prompts(saved, tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileError, match=r"empty: no \.jsonl, \.json, \.parquet, \.arrow files and no state\.json"):
        load_prompts(tmp_path / "empty", tokenizer)


@pytest.mark.parametrize("name", ["prompts.arrow", "hf_dataset", "verl.parquet"])
def test_without_pyarrow_the_error_names_the_extra(name: str, tokenizer, monkeypatch):
    for module in ("pyarrow", "pyarrow.parquet", "pyarrow.ipc"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=r"install it with: pip install 'megatron-rl\[data\]'"):
        load_prompts(FIXTURES / name, tokenizer, prompt_key="question" if name == "hf_dataset" else "prompt")


# ---------------------------------------------------------------------------------------------- keys and answers
def test_missing_keys_name_the_row_keys_and_the_closest(tokenizer):
    verl = FIXTURES / "verl.parquet"
    with pytest.raises(ValueError) as err:
        load_prompts(verl, tokenizer, answer_key="reward_model.ground_truh", apply_chat_template=True)
    assert str(err.value) == (
        f"{verl} row 1: missing key 'reward_model.ground_truh' (has ['ability', 'data_source', 'extra_info', "
        "'prompt', 'reward_model']); closest: 'reward_model.ground_truth'; set data.answer_key to the column of "
        "the reference answer, or to null if the rows have none"
    )
    with pytest.raises(ValueError, match=r"slime\.jsonl:1: missing key 'promt' .*; closest: 'prompt'$"):
        load_prompts(FIXTURES / "slime.jsonl", tokenizer, prompt_key="promt", answer_key="label")
    # TRL's prompt-only rows have no answer: answer_key=None (data.answer_key=null) reads them.
    no_answer = load_prompts(FIXTURES / "slime.jsonl", tokenizer, answer_key=None, apply_chat_template=True)
    assert no_answer[0].answer is None and no_answer[0].metadata == {"label": "1", "metadata": {"id": 0}}


def test_answers_become_text_and_nested_prompt_keys_work(tmp_path: Path, tokenizer):
    rows = [
        {"q": {"text": "a"}, "a": 3},
        {"q": {"text": "b"}, "a": 0.5},
        {"q": {"text": "c"}, "a": ["1", "2"]},
        {"q": {"text": "d"}, "a": None},
    ]
    path = tmp_path / "n.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts(path, tokenizer, prompt_key="q.text", answer_key="a")
    assert [(p.text, p.answer) for p in prompts] == [("a", "3"), ("b", "0.5"), ("c", '["1", "2"]'), ("d", None)]
    assert prompts[0].metadata == {"q": {"text": "a"}}  # a dotted key leaves its column in the metadata


def test_chat_template_required_and_messages_without_one_refused(tmp_path: Path, tokenizer):
    plain = build_char_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"^the tokenizer has no chat template, so data\.apply_chat_template=true "
                       r"cannot format the prompts: set data\.apply_chat_template=false to give the model each "
                       r"prompt's text as it is"):  # fmt: skip
        load_prompts(FIXTURES / "slime.jsonl", plain, answer_key="label", apply_chat_template=True)
    with pytest.raises(ValueError, match=r"slime\.jsonl:8: 'prompt' holds chat messages, which need the tokenizer's"):
        load_prompts(FIXTURES / "slime.jsonl", plain, answer_key="label")
    texts = load_prompts(FIXTURES / "hf_dataset", plain, prompt_key="question")  # text without a template: as is
    assert texts[0].text == "1+1=" and texts[0].token_ids == plain("1+1=")["input_ids"]
    (tmp_path / "m.jsonl").write_text(json.dumps({"prompt": [{"content": "x"}], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:1: 'prompt' item 0 is not a chat message \{role, content\}"):
        load_prompts(tmp_path / "m.jsonl", tokenizer, apply_chat_template=True)


# ---------------------------------------------------------------------------------------------- the mixture
def _source(tag: str, n: int, seed: int) -> PromptIterator:
    return PromptIterator([Prompt(f"{tag}{i}", [i]) for i in range(n)], seed=seed)


def _mixture(weights: list[float], seed: int = 3) -> Mixture:
    return Mixture([_source(chr(97 + k), 5 + k, seed + k) for k in range(len(weights))], weights, seed=seed)


@pytest.mark.parametrize("weights", [[3.0, 1.0], [2.0, 1.0, 1.0]])
def test_mixture_draws_in_proportion_to_the_weights(weights: list[float]):
    n = 4000
    mixture = _mixture(weights)
    counts = Counter(next(mixture).text[0] for _ in range(n))
    # Binomial standard deviation of a share over 4000 draws is at most 0.008; 0.03 is ~4 of them.
    for k, weight in enumerate(weights):
        assert abs(counts[chr(97 + k)] / n - weight / sum(weights)) < 0.03, (counts, weights)
    same, other = _mixture(weights), _mixture(weights, seed=4)
    first = [next(same).text for _ in range(200)]
    again = _mixture(weights)
    assert first == [next(again).text for _ in range(200)]  # seeded
    assert first != [next(other).text for _ in range(200)]


def test_mixture_resumes_exactly():
    mixture = _mixture([1.0, 2.0, 0.5])
    for _ in range(1234):
        next(mixture)
    state = json.loads(json.dumps(mixture.state_dict()))  # survives a JSON checkpoint
    assert state["draws"] == 1234 and len(state["sources"]) == 3
    resumed = _mixture([1.0, 2.0, 0.5])
    resumed.load_state_dict(state)
    assert [next(resumed).text for _ in range(100)] == [next(mixture).text for _ in range(100)]
    with pytest.raises(ValueError, match=r"weights=\[1\.0, 2\.0, 0\.5\] but this run has \[1\.0, 2\.0, 1\.0\]"):
        _mixture([1.0, 2.0, 1.0]).load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint's mixture has 3 datasets but data.train lists 2"):
        _mixture([1.0, 2.0]).load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint's prompt position is of one dataset"):
        _mixture([1.0, 2.0]).load_state_dict(_source("a", 5, 3).state_dict())
    with pytest.raises(ValueError, match="is of a mixture of 3 datasets, but data.train is now one"):
        _source("a", 5, 3).load_state_dict(state)


def _cfg(*overrides: str):
    return load_config(EXAMPLE, ["data.eval=null", "data.eval_every=0", "data.reward=exact_match", *overrides])


def test_prompt_data_mixture_sources_and_longest_prompt(tokenizer):
    train = (
        f"data.train=[{{path: {FIXTURES / 'verl.parquet'}, weight: 3}}, {{path: {FIXTURES / 'prompts.arrow'}}}]"
    )
    cfg = _cfg(train, "data.answer_key=reward_model.ground_truth")
    with pytest.raises(ValueError, match=r"prompts\.arrow row 1: missing key 'reward_model\.ground_truth'"):
        prompt_data(cfg, tokenizer)  # the keys are the same for every file of a mixture: the second has none
    slime = f"data.eval={FIXTURES / 'slime.jsonl'}", "data.eval_every=5"
    data = prompt_data(_cfg(train, *slime, "data.answer_key=null"), tokenizer)
    assert data.data_sources() == {"openai/gsm8k", "rev"}  # slime's rows have no data_source
    assert len(data.train_prompts) == 16 and len(data.eval_prompts("slime")) == 8  # data.eval_prompts=64 > 8 rows
    # The longest is slime's system-prompt row: the chat template of [system, user] beats every [user] prompt.
    slime_rows = load_prompts(FIXTURES / "slime.jsonl", tokenizer, answer_key=None, apply_chat_template=True)
    longest = len(slime_rows[7].token_ids)
    assert data.longest_prompt() == (longest, f"{FIXTURES / 'slime.jsonl'}:8")
    drawn = Counter("rev" if next(data.stream).metadata.get("data_source") == "rev" else "verl" for _ in range(400))
    assert 0.17 < drawn["rev"] / 400 < 0.33  # weight 1 of 4; the binomial sd is 0.022
    state = json.loads(json.dumps(data.state_dict()))
    again = prompt_data(_cfg(train, "data.answer_key=null"), tokenizer)
    again.load_state_dict(state)
    assert [next(again.stream).text for _ in range(20)] == [next(data.stream).text for _ in range(20)]
    single = prompt_data(_cfg(f"data.train={FIXTURES / 'slime.jsonl'}", "data.answer_key=label"), tokenizer)
    assert set(single.state_dict()["prompts"]) == {"epoch", "index", "seed", "shuffle", "num_prompts"}  # as before
    assert single.data_sources() == set() and single.longest_prompt()[1].endswith("slime.jsonl:8")
    assert prompt_data(_cfg(), tokenizer).longest_prompt() == (0, "")  # the built-in task
    with pytest.raises(ValueError, match="data.reward=auto does not know data_source 'rev'"):  # data_sources() routed
        prompt_data(_cfg(f"data.train={FIXTURES / 'prompts.arrow'}", "data.reward=auto"), tokenizer)
    with pytest.raises(ValueError, match="data.train mixes a built-in task with data files"):  # at config load
        _cfg(f"data.train=[{{path: synthetic}}, {{path: {FIXTURES / 'slime.jsonl'}}}]")


# ---------------------------------------------------------------------------------------------- training on each
FORMATS = {
    "verl_parquet": ("verl.parquet", "prompt", "reward_model.ground_truth"),
    "slime_jsonl": ("slime.jsonl", "prompt", "label"),
    "trl_chat_jsonl": ("trl_chat.jsonl", "prompt", "solution"),
    "datasets_folder": ("hf_dataset", "question", "answer"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_rl.tiny_model import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("formats_model") / "model", seed=1234)


@pytest.mark.parametrize("layout", FORMATS)
def test_each_layout_trains_two_steps(layout: str, model_dir: Path, tmp_path: Path, tokenizer):
    name, prompt_key, answer_key = FORMATS[layout]
    keys = [f"data.train={FIXTURES / name}", f"data.prompt_key={prompt_key}", f"data.answer_key={answer_key}"]
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"model.hf_path={model_dir}",
         f"trainer.output_dir={out}", *keys, "data.reward=exact_match", "data.eval=null", "data.eval_every=0",
         "warmup.sft_steps=0", "trainer.steps=2", "trainer.save_every=0", "rollout.n_samples=2",
         "rollout.prompts_per_step=2", "rollout.sampling.max_new_tokens=4", "logging.wandb=false",
         "logging.plot=false", "logging.samples_per_step=4"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if r["step"] > 0] == [1, 2]
    # What the model was prompted with is the fixture's rows, chat template applied.
    expected = {p.text for p in load_prompts(FIXTURES / name, tokenizer, prompt_key=prompt_key,
                                             answer_key=answer_key, apply_chat_template=True)}  # fmt: skip
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert {s["prompt"] for s in samples} <= expected and len({s["prompt"] for s in samples}) >= 2


def test_the_docs_table_keys_load_and_read_the_fixtures(tokenizer):
    """docs/datasets.md's layouts table: every `Set` cell's overrides load as a config, and the verl, slime and TRL
    rows' keys read the fixture of that layout."""
    table = (ROOT / "docs" / "datasets.md").read_text().split("## The layouts people bring", 1)[1].split("\n## ")[0]
    cells = {
        row.split("|")[1].strip(): re.findall(r"`(data\.[a-z_]+=[^` ]+)", row.split("|")[3])
        for row in table.splitlines()
        if row.startswith("| ") and not row.startswith("| Layout")
    }
    assert len(cells) == 7 and all(cells[name] for name in cells if not name.startswith("TRL conversational"))
    for overrides in cells.values():
        load_config(EXAMPLE, ["data.eval=null", "data.eval_every=0", *overrides])  # every key exists and parses
    for name, fixture in [("verl", "verl.parquet"), ("slime", "slime.jsonl"), ("TRL prompt-only", "trl_chat.jsonl")]:
        overrides = next(v for k, v in cells.items() if k.startswith(name))
        data = load_config(EXAMPLE, ["data.eval=null", "data.eval_every=0", overrides[0]]).data
        keys = {"prompt_key": data.prompt_key, "answer_key": data.answer_key, "apply_chat_template": True}
        assert all(p.answer for p in load_prompts(FIXTURES / fixture, tokenizer, **keys)), name


def test_a_datasetdict_folder_is_refused_before_the_model_is_built(tmp_path: Path):
    splits = tmp_path / "gsm8k"
    for split in ("train", "test"):
        make_fixtures.write_saved_dataset(splits / split, [{"prompt": "1+1=", "answer": "2"}])
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    model = tmp_path / "model"  # build_tiny_if_missing: the check comes first, so nothing is built
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"data.train={splits}", "data.eval=null",
         "data.eval_every=0", f"model.hf_path={model}", f"trainer.output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"megatron-rl train: error: data.train: {splits} is a DatasetDict with the splits 'train', 'test': name "
        f"one split's folder, e.g. data.train={splits / 'train'}"
    )
    assert not model.exists()


@pytest.mark.slow  # the Mixture's own resume test (default tier) covers the positions; this adds the trainer's path
def test_a_mixture_run_resumes_with_the_same_prompts(model_dir: Path, tmp_path: Path):
    """3 steps on a 2-file mixture, and the same run stopped after step 1 and resumed: steps 2 and 3 draw the same
    prompts from the same files (the checkpoint holds the mixture's draw count and each file's position)."""
    for name, rows in {"sums": [(f"{a}+{b}=", str(a + b)) for a, b in make_fixtures.SUMS],
                       "revs": [(f"{a}{b}", f"{b}{a}") for a, b in make_fixtures.SUMS]}.items():  # fmt: skip
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    mixture = f"data.train=[{{path: {tmp_path / 'sums.jsonl'}}}, {{path: {tmp_path / 'revs.jsonl'}}}]"

    def train(out: Path, steps: int) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"model.hf_path={model_dir}",
             f"trainer.output_dir={out}", mixture, "data.reward=exact_match", "data.eval=null", "data.eval_every=0",
             "warmup.sft_steps=0", f"trainer.steps={steps}", "trainer.save_every=1", "trainer.keep_last=0",
             "rollout.n_samples=2", "rollout.prompts_per_step=4", "rollout.sampling.max_new_tokens=4",
             "logging.wandb=false", "logging.plot=false", "logging.samples_per_step=8"],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    def prompts(out: Path) -> dict[int, list[str]]:
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        return {step: [r["prompt"] for r in rows if r["step"] == step] for step in (2, 3)}

    whole, split = tmp_path / "whole", tmp_path / "split"
    train(whole, 3)
    train(split, 1)
    train(split, 3)  # resume=auto continues from step 1
    assert prompts(split) == prompts(whole)
    drawn = [p for step in prompts(whole).values() for p in step]
    assert len(drawn) == 16 and any("+" in p for p in drawn) and any("+" not in p for p in drawn)  # both files


def test_the_shipped_fixtures_are_what_the_script_writes(tmp_path: Path):
    make_fixtures.main(tmp_path)
    for name in ("verl.parquet", "slime.jsonl", "trl_chat.jsonl", "hf_dataset", "prompts.arrow"):
        assert [r for _, r in read_rows(tmp_path / name)] == [r for _, r in read_rows(FIXTURES / name)], name
