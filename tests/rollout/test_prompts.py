"""Prompt files (JSONL, Parquet), chat templates, errors, and the seeded, resumable prompt iterator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.prompts import Prompt, PromptIterator, load_prompts


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a trailing blank line is skipped
    return path


def test_jsonl_with_custom_keys(tmp_path: Path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"q": "1+2=", "a": 3, "level": 1}, {"q": "hi", "a": "x", "level": 2}])
    prompts = load_prompts(path, tokenizer, prompt_key="q", answer_key="a")
    assert prompts[0] == Prompt("1+2=", tokenizer("1+2=")["input_ids"], "3", {"level": 1})
    assert len(prompts[0].token_ids) == 4 and prompts[1].answer == "x"


def test_chat_template(tmp_path: Path, tokenizer):
    rows = [
        {"prompt": "hi", "answer": "1"},
        {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "answer": "2"},
    ]
    prompts = load_prompts(_write_jsonl(tmp_path / "c.jsonl", rows), tokenizer, apply_chat_template=True)
    assert prompts[0].text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompts[0].token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # one special token
    assert len(prompts[0].token_ids) == 1 + 4 + 1 + 2 + 1 + 1 + 1 + 9 + 1  # specials are single tokens
    assert prompts[1].text.startswith("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n")
    needs_template = r"c.jsonl:2: 'prompt' holds chat messages, which need the tokenizer's chat template: set data\."
    with pytest.raises(ValueError, match=needs_template + "apply_chat_template=true"):
        load_prompts(tmp_path / "c.jsonl", tokenizer)


def test_errors_name_the_path_key_and_line(tmp_path: Path, tokenizer):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl", tokenizer)
    path = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    with path.open("a") as f:
        f.write(json.dumps({"prompt": "c"}) + "\n")  # line 4 (line 3 is blank)
    with pytest.raises(ValueError, match=r"m.jsonl:4: missing key 'answer'"):
        load_prompts(path, tokenizer)
    assert len(load_prompts(path, tokenizer, answer_key=None)) == 3
    with pytest.raises(ValueError, match="missing key 'question'"):
        load_prompts(path, tokenizer, prompt_key="question", answer_key=None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_prompts(bad, tokenizer, answer_key=None)


def test_max_prompt_tokens_drops_long_prompts(tmp_path: Path, tokenizer):
    path = _write_jsonl(tmp_path / "l.jsonl", [{"prompt": "x" * n, "answer": str(n)} for n in (3, 8, 5)])
    assert [p.answer for p in load_prompts(path, tokenizer, max_prompt_tokens=5)] == ["3", "5"]


def test_parquet_reads_like_jsonl(tmp_path: Path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": "12+30=", "a": "42", "extra": i} for i in range(3)] + [{"q": "7*6=", "a": "42", "extra": 9}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    from_parquet = load_prompts(tmp_path / "p.parquet", tokenizer, prompt_key="q", answer_key="a")
    from_jsonl = load_prompts(_write_jsonl(tmp_path / "p.jsonl", rows), tokenizer, prompt_key="q", answer_key="a")
    assert [(p.token_ids, p.answer) for p in from_parquet] == [(p.token_ids, p.answer) for p in from_jsonl]
    assert from_parquet[3].token_ids == tokenizer("7*6=", add_special_tokens=False)["input_ids"]
    pq.write_table(pa.Table.from_pylist([{"q": "1+1=", "a": "2"}, {"q": None, "a": "3"}]), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="row 2"):
        load_prompts(tmp_path / "b.parquet", tokenizer, prompt_key="q", answer_key="a")


def test_parquet_without_pyarrow_names_the_install(tmp_path: Path, tokenizer, monkeypatch):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed (None in sys.modules: ImportError)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'megatron-rl\[data\]'"):
        load_prompts(path, tokenizer)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(str(i), [i], str(i)) for i in range(n)]


def test_iterator_epochs_are_seeded_permutations():
    it = PromptIterator(_prompts(6), seed=1)
    epochs = [[next(it).text for _ in range(6)] for _ in range(3)]
    assert all(sorted(e) == [str(i) for i in range(6)] for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = PromptIterator(_prompts(6), seed=1)
    assert [next(again).text for _ in range(18)] == sum(epochs, [])
    other = PromptIterator(_prompts(6), seed=2)
    assert [next(other).text for _ in range(6)] != epochs[0]
    plain = PromptIterator(_prompts(3), shuffle=False)
    assert [next(plain).text for _ in range(4)] == ["0", "1", "2", "0"]


def test_iterator_resumes_from_state_dict():
    it = PromptIterator(_prompts(5), seed=7)
    for _ in range(8):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))  # survives a JSON checkpoint
    assert (state["epoch"], state["index"]) == (1, 3)
    resumed = PromptIterator(_prompts(5), seed=7)
    resumed.load_state_dict(state)
    assert [next(resumed).text for _ in range(12)] == [next(it).text for _ in range(12)]
    with pytest.raises(ValueError, match="num_prompts=5 but this iterator has 4"):
        PromptIterator(_prompts(4), seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=7 but this iterator has 8"):
        PromptIterator(_prompts(5), seed=8).load_state_dict(state)
