"""SFT examples from rows: which tokens train (chat template on growing prefixes), refusals, the seeded order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.rollout.sft_data import SFTDataError, SFTDataset, sft_example
from megatron_rl.tiny_model import build_char_tokenizer

CHAT = {"prompt_key": "prompt", "response_key": "response", "apply_chat_template": True}


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _trained(pair) -> list[int]:
    return [t for t, m in zip(pair.response_ids, pair.loss_mask, strict=True) if m]


def test_two_assistant_turns_train_exactly_their_tokens(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6, sure"},
    ]
    pair = sft_example({"messages": messages}, "chat.jsonl:1", tokenizer, **CHAT)  # TRL's `messages` column
    # The tiny template by hand: <|im_start|>{role}\n{content}<|im_end|>\n per message.
    prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    spans = [
        ("4<|im_end|>", 1),
        ("\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("6, sure<|im_end|>", 1),
    ]
    assert pair.prompt_ids == _ids(tokenizer, prompt)
    assert pair.response_ids == [t for text, _ in spans for t in _ids(tokenizer, text)]
    assert pair.loss_mask == [m for text, m in spans for _ in _ids(tokenizer, text)]
    assert sum(pair.loss_mask) == 2 + 8  # "4" + EOS, "6, sure" + EOS
    eos = tokenizer.eos_token_id
    assert _trained(pair) == _ids(tokenizer, "4") + [eos] + _ids(tokenizer, "6, sure") + [eos]
    # The whole sequence is the template's own rendering of the conversation (minus the newline after the last EOS).
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert pair.prompt_ids + pair.response_ids == _ids(tokenizer, full.removesuffix("\n"))


def test_prompt_and_response_columns(tokenizer):
    row = {"question": "Tom has 3 apples and buys 4 more.", "meta": {"solution": "3 + 4 = 7\n#### 7"}}
    options = {"prompt_key": "question", "response_key": "meta.solution"}  # a dotted key into a nested column
    pair = sft_example(row, "gsm8k.jsonl:1", tokenizer, apply_chat_template=True, **options)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": row["question"]}], tokenize=False, add_generation_prompt=True
    )
    assert pair.prompt_ids == _ids(tokenizer, rendered)  # what the rollout's prompt is
    assert pair.response_ids == _ids(tokenizer, "3 + 4 = 7\n#### 7") + [tokenizer.eos_token_id]
    assert pair.loss_mask == [1] * 17
    # Without a chat template: the text as it is, the response and EOS.
    plain = sft_example(row, "gsm8k.jsonl:1", tokenizer, apply_chat_template=False, **options)
    assert plain.prompt_ids == _ids(tokenizer, row["question"])
    assert plain.response_ids == pair.response_ids and plain.loss_mask == [1] * 17


def test_chat_prompt_plus_response_column(tokenizer):
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "response": "a"}
    pair = sft_example(row, "x.jsonl:1", tokenizer, **CHAT)
    assert tokenizer.decode(pair.prompt_ids) == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip
    assert _trained(pair) == _ids(tokenizer, "a") + [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "q2"}]},  # fmt: skip
            r"data.jsonl:7: the conversation ends in 'user' turn, not an assistant turn, and the row has no "
            r"'response' column \(warmup.response_key\)",
        ),
        ({"other": 1}, r"data.jsonl:7: no 'prompt' column .* and no 'messages' column; the row has \['other'\]"),
        ({"prompt": 5, "response": "a"}, r"data.jsonl:7: 'prompt' must be text or a list of chat messages"),
    ],
)
def test_rows_refused_with_the_row_named(tokenizer, row, message):
    with pytest.raises(SFTDataError, match=message):
        sft_example(row, "data.jsonl:7", tokenizer, **CHAT)


def test_plain_rows_refuse_chat_messages(tokenizer):
    row = {"prompt": [{"role": "user", "content": "q"}], "response": "a"}
    with pytest.raises(SFTDataError, match=r"x:3: 'prompt' is a list; chat messages need data.apply_chat_template"):
        sft_example(row, "x:3", tokenizer, prompt_key="prompt", response_key="response", apply_chat_template=False)


def test_template_without_the_prefix_property_is_refused():
    """A template that rewrites earlier turns (here: it writes the number of messages first, as a template that
    drops past reasoning changes the earlier text) cannot give assistant masks by prefixes."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{{ messages|length }}\n" + tokenizer.chat_template
    row = {"prompt": "q", "response": "a"}
    refused = r"rows.jsonl:2: the chat template does not render the first 1 message\(s\) as a prefix"
    with pytest.raises(SFTDataError, match=refused):
        sft_example(row, "rows.jsonl:2", tokenizer, **CHAT)


def test_dataset_order_is_seeded_epoch_after_epoch_and_restartable(tmp_path: Path, tokenizer):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(5)))
    data = SFTDataset.from_file(path, tokenizer, seed=3, **CHAT)
    stream = [p.answer for p in data.sft_pairs(15, start=0)]
    for epoch in range(3):  # every example once per epoch, in an order of its own
        assert sorted(stream[5 * epoch : 5 * epoch + 5]) == [f"a{i}" for i in range(5)]
    assert stream[:5] != stream[5:10] or stream[5:10] != stream[10:15]
    again = SFTDataset.from_file(path, tokenizer, seed=3, **CHAT)
    assert [p.answer for p in again.sft_pairs(6, start=7)] == stream[7:13]  # a resumed warm-up draws the same
    other = SFTDataset.from_file(path, tokenizer, seed=4, **CHAT)
    assert [p.answer for p in other.sft_pairs(15, start=0)] != stream


def test_file_rows_are_named_by_line(tmp_path: Path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "q", "response": "a"}) + "\n" + json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(SFTDataError, match=r"bad.jsonl:2: the conversation ends in 'user' turn"):
        SFTDataset.from_file(path, tokenizer, seed=0, **CHAT)


def test_an_example_longer_than_the_model_is_refused_naming_it(tmp_path: Path, tokenizer):
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "q", "response": "a"}, {"prompt": "q" * 300, "response": "a"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = SFTDataset.from_file(path, tokenizer, seed=0, **CHAT)
    data.check_lengths(400)  # 19 template tokens + 300 + "a" and EOS: 321
    with pytest.raises(SFTDataError, match=r"long.jsonl:2: the SFT example has 321 tokens, more than the model's 256 "
                       r"positions \(1 of 2 examples are too long\)"):  # fmt: skip
        data.check_lengths(256)


def test_parquet_rows_with_chat_prompts_and_a_nested_response(tmp_path: Path, tokenizer):
    """verl's layout: the prompt as chat messages, the target in a nested column (`warmup.response_key` dotted)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "extra_info": {"answer": f"a{i}"}} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = SFTDataset.from_file(
        path, tokenizer, prompt_key="prompt", response_key="extra_info.answer", apply_chat_template=True, seed=0
    )
    assert sorted(p.answer for p in data.examples) == ["a0", "a1", "a2"]
    assert data.where[1] == f"{path} row 2"
    pair = data.examples[1]
    assert _trained(pair) == _ids(tokenizer, "a1") + [tokenizer.eos_token_id]
    assert tokenizer.decode(pair.prompt_ids) == "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n"
