"""A small pool of killable worker processes for reward calls: a call past its deadline is killed with its worker,
and a fresh worker takes its place.

Workers are plain `python -m megatron_rl.rollout.rewards.worker` processes talking over two pipes (not
multiprocessing's spawn or forkserver: those re-import the user's `__main__` script in every worker). A call is
sent pickled (the function by reference, its options and light `RewardInput`s) and answered with an `Outcome`.
A worker ignores Ctrl-C (the trainer stops at a step boundary) and exits when its pipe closes.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from megatron_rl.rollout.rewards.user_functions import Failure, Outcome, RewardTask

_START_TIMEOUT_S = 120  # a worker imports the rewards package before it answers "ready"
_LOAD, _CALL = b"L", b"C"  # a message to a worker: import this function / run this task
_CHUNK = 16  # tasks sent to a worker at once, at most ...
_CHUNK_BYTES = 32 * 1024  # ... and this many bytes of them (a pipe buffers 64 KiB)


class _Worker:
    """One worker process and the parent's ends of its pipes."""

    def __init__(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        module = "megatron_rl.rollout.rewards.worker"
        command = [sys.executable, "-m", module, str(to_child_r), str(from_child_w), json.dumps(sys.path)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # finds what the parent finds
        self.process = subprocess.Popen(command, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env)
        os.close(to_child_r)
        os.close(from_child_w)
        self.send = Connection(to_child_w, readable=False)
        self.receive = Connection(from_child_r, writable=False)
        self.loaded: dict[bytes, str | None] = {}  # pickled function -> None once imported here, or why it failed

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.send.close()
        self.receive.close()


@dataclass
class _Busy:
    """A worker's tasks sent and not answered yet (the first is running) and the running one's deadline."""

    worker: _Worker
    tasks: deque[int]
    deadline: float


class WorkerPool:
    """Up to `size` worker processes, started on first use and kept for later calls; `run` is serialised."""

    def __init__(self, size: int):
        self.size = size
        self._idle: list[_Worker] = []
        self._alive: set[_Worker] = set()  # every worker not yet killed, idle or busy
        self._sys_path = list(sys.path)  # the import path the workers were started with
        self._lock = threading.Lock()
        self.started = 0  # workers started so far (replacements included)
        self.killed = 0  # workers killed: a call past its deadline, a worker that died, `close`
        atexit.register(self.close)

    def run(self, tasks: list[RewardTask], timeout_s: float) -> list[Outcome]:
        """Each task's outcome; a task running past `timeout_s` (counted from when its worker began it) is a
        timed-out Failure and its worker is killed and replaced.

        A worker gets a few small tasks at once (up to `_CHUNK` and `_CHUNK_BYTES`: below a pipe's buffer, so
        sending never blocks on a worker that hangs) and answers each as it finishes; the next one's deadline starts
        with that answer. Tasks queued behind a killed one go to other workers.
        """
        with self._lock:
            if sys.path != self._sys_path:  # e.g. a second run's plugin folder: workers import with the new path
                self.close()
                self._sys_path = list(sys.path)
            outcomes: list[Outcome | None] = [None] * len(tasks)
            functions: dict[int, bytes] = {}  # id(fn) -> its pickle (by reference: module and name)
            failed: dict[bytes, str] = {}  # functions whose import hung in a worker
            todo = deque(range(len(tasks)))
            busy: dict[Connection, _Busy] = {}  # receive end -> what its worker holds
            while todo or busy:
                self._ensure_idle(min(self.size - len(busy), len(todo)))
                while todo and self._idle:
                    worker = self._idle.pop()
                    sent = self._dispatch(worker, tasks, todo, outcomes, functions, failed)
                    if sent:
                        busy[worker.receive] = _Busy(worker, sent, time.monotonic() + timeout_s)
                    elif worker in self._alive:
                        self._idle.append(worker)
                if not busy:
                    continue
                next_deadline = min(b.deadline for b in busy.values())
                for conn in wait(list(busy), timeout=max(next_deadline - time.monotonic(), 0.0)):
                    held = busy[conn]  # type: ignore[index]
                    i = held.tasks.popleft()
                    try:
                        outcomes[i] = held.worker.receive.recv()
                    except (EOFError, OSError):
                        outcomes[i] = Failure(f"the reward worker died (exit code {held.worker.process.poll()})")
                        self._release(busy, held, todo)
                        continue
                    held.deadline = time.monotonic() + timeout_s
                    if not held.tasks:
                        del busy[conn]  # type: ignore[arg-type]
                        self._idle.append(held.worker)
                now = time.monotonic()
                for held in [b for b in busy.values() if now >= b.deadline]:
                    outcomes[held.tasks.popleft()] = Failure(f"timed out after {timeout_s:g} s", timed_out=True)
                    self._release(busy, held, todo)
            return [o if o is not None else Failure("no outcome") for o in outcomes]

    def _dispatch(
        self,
        worker: _Worker,
        tasks: list[RewardTask],
        todo: deque[int],
        outcomes: list[Outcome | None],
        functions: dict[int, bytes],
        failed: dict[bytes, str],
    ) -> deque[int]:
        """Send `worker` the next few tasks of `todo` (importing their function there first); the tasks sent. A task
        that cannot be sent or whose function does not import gets its Failure in `outcomes` (a function whose
        import hangs is in `failed`, not tried again in this run)."""
        sent: deque[int] = deque()
        size, limit = 0, min(_CHUNK, max(1, len(todo) // (2 * self.size)))
        while todo and len(sent) < limit and (not sent or size < _CHUNK_BYTES):
            i = todo.popleft()
            try:
                function = functions.setdefault(id(tasks[i].fn), pickle.dumps(tasks[i].fn))
                payload = _CALL + pickle.dumps(tasks[i])
            except Exception as err:  # noqa: BLE001 - options or metadata that cannot be pickled
                outcomes[i] = Failure(f"cannot send the call to a worker: {type(err).__name__}: {err}")
                continue
            if sent and size + len(payload) > _CHUNK_BYTES:
                todo.appendleft(i)
                break
            if function in failed:
                outcomes[i] = Failure(failed[function])
                continue
            try:
                if function not in worker.loaded and not self._load(worker, function):
                    failed[function] = f"the reward's module did not import in a worker within {_START_TIMEOUT_S} s"
                    outcomes[i] = Failure(failed[function])
                    todo.extendleft(reversed(sent))
                    return deque()
                if worker.loaded[function] is not None:
                    outcomes[i] = Failure(f"cannot load the reward in its worker: {worker.loaded[function]}")
                    continue
                worker.send.send_bytes(payload)
            except (OSError, EOFError):  # the worker died (killed from outside): another one takes its tasks
                todo.extendleft(reversed([*sent, i]))
                self._kill(worker)
                return deque()
            sent.append(i)
            size += len(payload)
        return sent

    def _release(self, busy: dict[Connection, _Busy], held: _Busy, todo: deque[int]) -> None:
        """Kill a worker whose current task failed; the tasks queued behind it go back to the front of `todo`."""
        del busy[held.worker.receive]
        todo.extendleft(reversed(held.tasks))
        self._kill(held.worker)

    def _ensure_idle(self, wanted: int) -> None:
        """Start workers (all at once, then wait for each to be ready) until `wanted` are idle."""
        fresh = [_Worker() for _ in range(wanted - len(self._idle))]
        self._alive.update(fresh)
        self.started += len(fresh)
        for worker in fresh:
            try:
                if not worker.receive.poll(_START_TIMEOUT_S):
                    raise EOFError(f"not ready after {_START_TIMEOUT_S} s")
                worker.receive.recv_bytes()  # b"ready": imports done, so start-up does not count against a call
                self._idle.append(worker)
            except (EOFError, OSError) as err:
                self._kill(worker)
                code = worker.process.poll()
                raise RuntimeError(f"a reward worker process failed to start ({err}; exit code {code})") from err

    def _load(self, worker: _Worker, function: bytes) -> bool:
        """Have `worker` import `function` (its module) before any call of it is timed: a user's module may import
        torch or a checker that takes seconds. False (the worker killed) when that takes over 120 s; EOFError if
        the worker dies."""
        worker.send.send_bytes(_LOAD + function)
        if not worker.receive.poll(_START_TIMEOUT_S):
            self._kill(worker)
            return False
        worker.loaded[function] = worker.receive.recv()
        return True

    def _kill(self, worker: _Worker) -> None:
        worker.kill()
        self._alive.discard(worker)
        self.killed += 1

    def close(self) -> None:
        """Stop every worker, also one left busy by an interrupted `run` (at exit: none outlives the trainer)."""
        while self._alive:
            self._kill(next(iter(self._alive)))
        self._idle.clear()


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def shared_pool(size: int) -> WorkerPool:
    """The process's reward worker pool (rollouts and evaluations share it), grown to at least `size` workers."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = WorkerPool(size)
        _POOL.size = max(_POOL.size, size)
        return _POOL
