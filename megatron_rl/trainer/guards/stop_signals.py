"""Ctrl-C / SIGTERM during training: stop at the next step boundary on every rank; a second signal aborts.

`StopSignals` is a context manager: it installs its handlers on entry (main thread only) and puts the previous
ones back on exit, so nothing outlives the run. Before the loop is armed (model build, warm-up: nothing to save
yet) a signal aborts at once; once armed, the first signal only sets a flag that the loop reads, collectively,
at each step boundary (`agreed`), and a second one aborts. An abort raises `TrainingAborted`, a BaseException
like KeyboardInterrupt, so the trainer's `finally` blocks still shut the rollout engine and process group down
and no `except Exception` on the way swallows it; the command turns it into one line and exit code 128 + signal.

Under torchrun a Ctrl-C reaches each worker twice (from the terminal, and forwarded by torchrun's agent, which then
waits its `--shutdown-timeout`, 30 s by default, before killing the workers), so there a repeated signal is not a
second request: it is ignored, and the workers stop at the step boundary (or abort, before training started).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingAborted(BaseException):
    """Training was stopped by a signal without reaching a step boundary; the message is the one line to show."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGINT/SIGTERM handling of one training run (see the module docstring)."""

    def __init__(self, resume_command: str, *, announce: bool = True):
        self.resume_command = resume_command
        self.announce = announce  # rank 0 says what it will do; the other ranks stay quiet
        self.armed = False  # set when the loop can stop at a step boundary
        self.requested: int | None = None  # the first signal received while armed
        self.step: int | None = None  # the RL step in progress
        self.last_checkpoint: int | None = None  # the step of the newest checkpoint on disk
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # to restore on exit
        self._pid = os.getpid()
        self._writing: str | None = None  # a checkpoint write in progress: an abort waits for its end
        self._deferred: int | None = None  # the signal of an abort that waits for the write
        self.under_torchrun = under_torchrun()  # a repeated signal is torchrun's agent forwarding the first one
        self._aborting = False  # an abort was raised (torchrun: later signals are ignored while it unwinds)

    def __enter__(self) -> StopSignals:
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """A write that an abort should not cut in half (a checkpoint: its writer processes would be left
        behind): an abort during it waits for its end; a third signal aborts anyway."""
        self._writing = what
        try:
            yield
        finally:
            self._writing = None
        if self._deferred is not None:
            raise self._abort(self._deferred)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            return  # a forked helper (checkpoint writer) inherited the handler: the trainer decides
        name = signal.Signals(signum).name
        if self.under_torchrun and (self.requested is not None or self._aborting):
            return  # the same Ctrl-C again, forwarded by torchrun's agent
        if self.armed and self.requested is None:
            self._ask_to_stop(signum, name)
        elif self._writing is not None and self._deferred is None:
            self._deferred = signum
            if self.announce:
                os.write(
                    2, f"{name}: finishing the {self._writing} first ({_key(signum)} again to abort anyway)\n".encode()
                )
        else:
            raise self._abort(signum)

    def _abort(self, signum: int) -> TrainingAborted:
        self._aborting = True
        name = signal.Signals(signum).name
        if self.step is None:  # nothing of this start is on disk yet
            return TrainingAborted(signum, f"interrupted ({name}) before training started; resume with: "
                                   f"{self.resume_command}")  # fmt: skip
        if self.last_checkpoint == self.step:  # the step and its checkpoint are complete
            return TrainingAborted(signum, f"interrupted after step {self.step} ({name}); {self._tail()}")
        return TrainingAborted(
            signum, f"interrupted during step {self.step} ({name}: the step is lost); {self._tail()}"
        )

    def _ask_to_stop(self, signum: int, name: str) -> None:
        self.requested = signum
        if self.announce:  # os.write: print() may be in progress on this thread and is not reentrant
            again = "torchrun ends the workers after its --shutdown-timeout" if self.under_torchrun else (
                f"{_key(signum)} again to abort now")  # fmt: skip
            os.write(2, f"{name}: stopping at the end of this step on every rank ({again})\n".encode())

    def agreed(self) -> int | None:
        """Collective (every rank calls it at the same step boundary): the signal any rank got, or None."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        gathered: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.requested)
        received = [s for s in gathered if s is not None]
        return min(received) if received else None

    def stopped_message(self, step: int, *, saved_now: bool) -> str:
        """The line printed when the loop stops at the boundary after `step`."""
        note = ""
        if saved_now:
            note = " (saved now: trainer.save_on_interrupt=true)"
        elif self.last_checkpoint is not None and self.last_checkpoint < step:
            note = f" (trainer.save_on_interrupt=false: steps {self.last_checkpoint + 1}-{step} run again)"
        return f"interrupted at step {step}; {self._tail(note)}"

    def _tail(self, note: str = "") -> str:
        last = "none (a resume starts at step 0)" if self.last_checkpoint is None else str(self.last_checkpoint)
        return f"last checkpoint step {last}{note}; resume with: {self.resume_command}"


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun (torch.distributed.run) started."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def _key(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
