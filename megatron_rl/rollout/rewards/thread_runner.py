"""Reward calls on daemon threads, for functions that cannot be sent to a worker process (closures, lambdas, ones
defined in `__main__`): a call past its timeout is abandoned, not killed (Python cannot kill a thread)."""

from __future__ import annotations

import queue
import threading
import time

from megatron_rl.rollout.rewards.user_functions import Failure, Outcome, RewardTask, run_task


def run_in_threads(tasks: list[RewardTask], timeout_s: float, max_workers: int) -> list[Outcome]:
    """Each task's outcome, on up to `max_workers` daemon threads, each call limited to `timeout_s` from its start.

    Each thread runs tasks one after another (a thread per task cost ~0.6 ms to start). Python cannot kill a
    thread: a worker whose call hangs is abandoned (daemon, so it never blocks exit; its late result is discarded)
    and a new worker takes over the remaining tasks, so a hung call stops counting against `max_workers`.
    """
    done: queue.Queue[tuple[int, Outcome]] = queue.Queue()
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(tasks)):
        todo.put(i)
    outcomes: dict[int, Outcome] = {}
    running: dict[int, tuple[int, float]] = {}  # worker -> (task it runs, start time); written by the worker
    abandoned: set[int] = set()

    def work(worker: int) -> None:
        while worker not in abandoned:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            running[worker] = (i, time.monotonic())
            outcome = run_task(tasks[i])
            running.pop(worker, None)
            done.put((i, outcome))

    workers = 0

    def start_worker() -> None:
        nonlocal workers
        threading.Thread(target=work, args=(workers,), name=f"reward-{workers}", daemon=True).start()
        workers += 1

    for _ in range(min(max_workers, len(tasks))):
        start_worker()
    while len(outcomes) < len(tasks):
        calls = [(w, i, t) for w, (i, t) in list(running.items()) if w not in abandoned]
        wait = min((t + timeout_s for _, _, t in calls), default=time.monotonic() + timeout_s) - time.monotonic()
        try:
            i, outcome = done.get(timeout=max(wait, 0.0))
        except queue.Empty:
            now = time.monotonic()
            for w, i, t in calls:
                if now - t >= timeout_s and i not in outcomes:
                    abandoned.add(w)
                    outcomes[i] = Failure(f"timed out after {timeout_s:g} s", timed_out=True)
                    start_worker()  # takes over the tasks left to run
            continue
        outcomes.setdefault(i, outcome)  # a late result of a call already timed out changes nothing
    return [outcomes[i] for i in range(len(tasks))]
