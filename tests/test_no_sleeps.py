"""No test synchronises by sleeping: it waits on an event, polls a condition with `tests.waiting.wait_until`
(a deadline and a message), or drives a fake explicitly. A sleep is allowed only as simulated work (a slow fake
tool, a payload a test kills, a fault's random timing) and says so on its line: `# simulated work`.

The scan is by line, so it also sees sleeps inside string payloads (code a sandbox or subprocess runs)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARK = "# simulated work"
SLEEP = re.compile(r"sleep\s*\(|\bsleep\s+[\d.]")  # a call of time.sleep or asyncio.sleep, a shell command
POLL = TESTS / "waiting.py"  # wait_until's poll interval: the one unmarked sleep


def unmarked_sleeps(source: str) -> list[int]:
    """The line numbers of `source` that sleep without the simulated-work mark."""
    return [n for n, line in enumerate(source.splitlines(), 1) if SLEEP.search(line) and MARK not in line]


def test_the_scanner_tells_a_marked_sleep_from_an_unmarked_one() -> None:
    call = "sleep"  # spelled apart so that this file holds no sleep of its own
    example = "\n".join([
        "import time",
        f"time.{call}(0.5)  {MARK}: a slow fake service",
        f"time.{call}(0.1)",
        f"await asyncio.{call} (1)",
        f'subprocess.run(["sh", "-c", "{call} 5"])',
        f"wait_until(done, 10, 'the {call}er to wake')",
    ])  # fmt: skip
    assert unmarked_sleeps(example) == [3, 4, 5]


def test_no_test_sleeps_unless_it_is_marked_simulated_work() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        lines = unmarked_sleeps(path.read_text(encoding="utf-8"))
        if path == POLL:
            assert len(lines) == 1, f"{path}: wait_until's poll is the one sleep allowed there, found lines {lines}"
            continue
        found += [f"{path.relative_to(TESTS.parent)}:{n}" for n in lines]
    assert not found, (
        f"sleeps that synchronise (wait with tests.waiting.wait_until or an event; mark real simulated work "
        f"'{MARK}' on its line): {', '.join(found)}"
    )
