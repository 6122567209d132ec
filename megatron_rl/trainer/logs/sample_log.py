"""What the model wrote: `samples.jsonl` (some of each step's rollout samples), `eval_samples.jsonl` (every
evaluation generation), the same rows for the wandb tables, and the console excerpt (`logging.show_samples`).

A row holds the prompt as the model saw it (`Prompt.text`: the chat template applied), the response decoded as
the reward function saw it (special tokens skipped; the stop token shows as `finish_reason: "stop"`; a
multi-turn trajectory's observations are part of it), the reward (and each named reward's unweighted value, as
`reward/<name>`), and for training rows the advantage and the group.

Which training samples: `pick_samples` takes the first sample of each group in group order, then the second of
each, and so on, so the rows spread over the step's prompts; no randomness, the same rows in a resumed run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import LoggingConfig
from megatron_rl.jsonl import records_before_step, replace_jsonl

SAMPLES_FILE = "samples.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"


def pick_samples(group_indices: Sequence[int], n: int) -> list[int]:
    """Indices of `n` samples spread over the groups: sample 0 of every group (in group order), then sample 1 of
    every group, ...; `group_indices[i]` is sample i's group."""
    by_group: dict[int, list[int]] = {}
    for i, group in enumerate(group_indices):
        by_group.setdefault(group, []).append(i)
    groups = [by_group[g] for g in sorted(by_group)]
    picked: list[int] = []
    for rank in range(max((len(g) for g in groups), default=0)):
        picked.extend(g[rank] for g in groups if rank < len(g))
    return picked[:n]


def _common(sample: Any, tokenizer: Any, advantage: float | None = None) -> dict[str, Any]:
    """The keys training and evaluation rows share (and a training row's advantage, after the rewards)."""
    metadata = sample.metadata
    if "prompt" in metadata:
        prompt = metadata["prompt"]
    else:  # a sample built without its prompt's text: the tokens the model saw
        prompt = tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)
    parts = getattr(sample, "reward_parts", {}) or {}
    return {
        "prompt": prompt,
        "response": tokenizer.decode(sample.response_ids, skip_special_tokens=True),  # what the reward read
        "reward": None if sample.reward is None else float(sample.reward),
        **{f"reward/{name}": float(value) for name, value in parts.items()},
        **({} if advantage is None else {"advantage": float(advantage)}),
        "length": len(sample.response_ids),
        "finish_reason": sample.finish_reason,
        "answer": metadata.get("answer"),
        "data_source": metadata.get("data_source"),
    }


def sample_rows(
    step: int, samples: Sequence[Any], advantages: Sequence[float | None], tokenizer: Any, picks: Sequence[int]
) -> list[dict[str, Any]]:
    """Rows of samples.jsonl for the samples `picks` of step `step`; `advantages[i]` is sample i's advantage (a
    sequence-level estimator gives every token of a sample the same one)."""
    return [
        {"step": step, "group": samples[i].group_index, **_common(samples[i], tokenizer, advantages[i])} for i in picks
    ]


def eval_rows(step: int, samples: Sequence[Any], tokenizer: Any, dataset: str) -> list[dict[str, Any]]:
    """Rows of eval_samples.jsonl: every evaluation sample of dataset `dataset` in the evaluation after step
    `step`; `group` is the prompt's index, `extracted_answer` the answer maj@k voted with (rewards that extract)."""
    rows = []
    for s in samples:
        row = {"step": step, "dataset": dataset, "group": s.group_index, **_common(s, tokenizer)}
        if "extracted_answer" in s.metadata:
            row["extracted_answer"] = s.metadata["extracted_answer"]
        rows.append(row)
    return rows


def cut_back(path: Path, first_step: int) -> int:
    """Keep the rows of `path` (JSONL with a `step` key) before `first_step`, in file order, and a row cut off by a
    crash goes; the file is replaced atomically. A resumed run writes its steps again. Returns the rows kept."""
    if not path.is_file():
        return 0
    kept = records_before_step(path, first_step)
    replace_jsonl(path, kept)
    return len(kept)


def one_line(text: str, width: int, *, keep_end: bool = False) -> str:
    """`text` on one line (newlines shown as `\\n`), at most `width` characters: the start (or, with `keep_end`,
    the end) kept, the rest replaced by `…`."""
    flat = text.replace("\r", "").replace("\n", "\\n")
    if len(flat) <= width:
        return flat
    return "…" + flat[-(width - 1) :] if keep_end else flat[: width - 1] + "…"


def format_samples(rows: Sequence[dict[str, Any]], width: int = 100) -> str:
    """The console excerpt: per sample a line of reward, advantage, finish reason and length, then the prompt's end
    and the response's start on one line each."""
    lines = []
    for row in rows:
        parts = ", ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in row.items() if k.startswith("reward/"))
        reward = "none" if row["reward"] is None else f"{row['reward']:.3f}"
        head = f"  sample (group {row.get('group', '-')}): reward {reward}" + (f" ({parts})" if parts else "")
        if "advantage" in row:
            head += f" | adv {row['advantage']:+.3f}"
        lines.append(f"{head} | {row['finish_reason']} | {row['length']} tokens")
        lines.append(f"    prompt   {one_line(row['prompt'], width, keep_end=True)}")
        lines.append(f"    response {one_line(row['response'], width)}")
    return "\n".join(lines)


class SampleLog:
    """Rank 0's samples files. `add_step` / `add_eval` build a step's rows when its samples are scored; `take`
    hands them to the run log with the step's metrics (written, tabled and printed after the step line).

    `first_step` is the first step this start logs: rows from it on are cut from both files (a resumed run redoes
    those steps)."""

    def __init__(self, cfg: LoggingConfig, output_dir: Path, tokenizer: Any, *, first_step: int = 0):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.paths = {"samples": output_dir / SAMPLES_FILE, "eval_samples": output_dir / EVAL_SAMPLES_FILE}
        for path in self.paths.values():
            cut_back(path, first_step)
        self._pending: dict[int, dict[str, list[dict[str, Any]]]] = {}
        self._shown: dict[int, list[dict[str, Any]]] = {}

    def due(self, step: int) -> bool:
        """Whether step `step` writes rows to samples.jsonl (`logging.samples_every`)."""
        every = self.cfg.samples_every
        return every > 0 and step % every == 0

    def add_step(self, step: int, samples: Sequence[Any], advantages: Sequence[float | None]) -> None:
        """The scored samples of RL step `step` and their advantages (one per sample; None: per token, by a critic)."""
        write = self.cfg.samples_per_step if self.due(step) else 0
        show = self.cfg.show_samples
        if not (write or show) or not samples:
            return
        picks = pick_samples([s.group_index for s in samples], max(write, show))
        rows = sample_rows(step, samples, advantages, self.tokenizer, picks)
        if write:
            self._pending.setdefault(step, {})["samples"] = rows[:write]
        if show:
            self._shown[step] = rows[:show]

    def add_eval(self, step: int, samples: Sequence[Any], dataset: str) -> None:
        """Every sample of the evaluation logged with step `step`."""
        rows = eval_rows(step, samples, self.tokenizer, dataset)
        self._pending.setdefault(step, {}).setdefault("eval_samples", []).extend(rows)

    def take(self, step: int) -> tuple[dict[str, list[dict[str, Any]]], str]:
        """Step `step`'s rows by table name ("samples", "eval_samples"), appended to their files, and the console
        excerpt ("" unless `logging.show_samples`)."""
        tables = self._pending.pop(step, {})
        for name, rows in tables.items():
            with self.paths[name].open("a") as f:
                f.write("".join(json.dumps(row, default=str) + "\n" for row in rows))  # a column of odd type: text
        shown = self._shown.pop(step, [])
        return tables, format_samples(shown) if shown else ""


def wandb_table(rows: Sequence[dict[str, Any]]) -> tuple[list[Any], list[list[Any]]]:
    """Columns and data of a wandb table of `rows` (the columns: every key, in first-seen order)."""
    columns: list[Any] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    return columns, [[row.get(c) for c in columns] for row in rows]
