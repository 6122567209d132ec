"""The one way tests wait for something: poll a condition until it holds, fail at a deadline naming what was awaited.

Tests do not synchronise by sleeping (tests/test_no_sleeps.py enforces it); this poll interval is the only sleep
that is not simulated work.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, *, interval_s: float = 0.01) -> None:
    """Call `condition` every `interval_s` until it returns something true; AssertionError naming `what` once
    `timeout_s` has passed. An exception from `condition` (an assertion that the wait is hopeless) propagates."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
