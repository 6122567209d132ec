"""Write examples/data/tiny_gsm8k/{train,test}.jsonl: GSM8K-format word problems over one-digit numbers.

Rows are `{"question": ..., "answer": "<worked solution>\\n#### <N>"}` exactly as GSM8K's, small enough for the tiny
demo model (char tokenizer, 256 positions) to learn on CPU: "Tom has 3 apples and buys 4 more. How many apples does
Tom have?" -> "3 + 4 = 7\\n#### 7". The test questions are not in the training file (the sums are: one-digit
arithmetic has only 100 + 55 of them). Deterministic: the same files on every run.

    python examples/data/make_tiny_gsm8k.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Tom", "Ann", "Sam", "Mia", "Ben", "Zoe", "Max", "Eva"]
THINGS = ["apples", "pens", "cats", "books", "cards", "eggs", "coins", "cups"]
# (question template, operator): the answer is "a op b = c\n#### c"
TEMPLATES = [
    ("{n} has {a} {t} and buys {b} more. How many {t} does {n} have?", "+"),
    ("{n} has {a} {t}. A friend gives {n} {b} more. How many {t} now?", "+"),
    ("{n} has {a} {t} and loses {b}. How many {t} are left?", "-"),
    ("{n} had {a} {t} and gave away {b}. How many {t} are left?", "-"),
]
TRAIN, TEST = 3000, 256


def problems(seed: int = 0) -> list[dict[str, str]]:
    """Every distinct question once, in a seeded order."""
    rows = []
    for template, op in TEMPLATES:
        for a in range(10):
            for b in range(10):
                if op == "-" and b > a:
                    continue
                c = a + b if op == "+" else a - b
                for n in NAMES:
                    for t in THINGS:
                        question = template.format(n=n, a=a, b=b, t=t)
                        rows.append({"question": question, "answer": f"{a} {op} {b} = {c}\n#### {c}"})
    random.Random(seed).shuffle(rows)
    return rows


def main() -> None:
    out = Path(__file__).parent / "tiny_gsm8k"
    out.mkdir(exist_ok=True)
    rows = problems()
    for name, part in (("test", rows[:TEST]), ("train", rows[TEST : TEST + TRAIN])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{out / name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
