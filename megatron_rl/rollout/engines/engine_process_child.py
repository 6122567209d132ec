"""The child side of `ProcessEngine`: a `LocalEngine` served over one pipe (see `engine_process.py`), and what
both sides agree on: the launch settings (`EngineLaunch`) and the layout of a weight bucket in the shared buffer
(`TensorSlot`).

The main thread reads requests `(id, method, args)` and answers `(id, ok, payload)`. Control requests (pause,
resume, abort, health, the token count) run right there, so they take effect while a `generate` is running;
`generate`, memory calls and the weight update run on worker threads, and `LocalEngine`'s lock orders them with
the decode steps. A weight update is a stream: `update_begin`, then one `update_bucket` per bucket (answered once
the engine has loaded it, so the parent may overwrite the shared buffer), then `update_end` (answered with the
new version) or `update_cancel` (the sender's buckets failed). The child exits when the pipe closes or its
parent changes (the parent died), so it never outlives the trainer.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from megatron_rl.rollout.engine import NamedTensorBucket

_PARENT_POLL_S = 1.0
_END = object()  # `update_end`: the sender's last bucket went out
_ALIGN = 64  # byte alignment of each tensor in the shared buffer (any dtype's element size divides it)


@dataclass(frozen=True)
class EngineLaunch:
    """What the child needs to build its `LocalEngine` (and what a restart builds again)."""

    model_dir: str
    device: str
    weight_version: str
    max_batch_size: int
    stop_on_eos: bool
    torch_threads: int


@dataclass(frozen=True)
class TensorSlot:
    """Where one HF-named tensor of a bucket lies in the shared buffer."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def bucket_slots(bucket: NamedTensorBucket) -> list[TensorSlot]:
    """A bucket's tensors laid out one after another, each at an aligned offset."""
    slots, offset = [], 0
    for name, tensor in bucket:
        slots.append(TensorSlot(name, offset, tuple(tensor.shape), tensor.dtype))
        offset += -(-_nbytes(tensor.shape, tensor.dtype) // _ALIGN) * _ALIGN
    return slots


def serve(conn: Connection, launch: EngineLaunch, parent_pid: int) -> None:
    """The child process's entry point: build the engine, answer requests until shutdown or the parent is gone."""
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(launch.torch_threads)
    hf_logging.disable_progress_bar()  # tqdm's lock is a named semaphore that the final os._exit would leak
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    server = _Server(conn)
    try:
        from megatron_rl.rollout.engines.local_engine import LocalEngine

        engine = LocalEngine(
            launch.model_dir,
            device=launch.device,
            weight_version=launch.weight_version,
            max_batch_size=launch.max_batch_size,
            stop_on_eos=launch.stop_on_eos,
        )
    except BaseException as err:
        server.answer(0, False, _picklable(err))
        os._exit(1)
    server.engine = engine
    server.answer(0, True, None)
    server.run()
    os._exit(0)  # worker threads may still hold torch calls of a shut-down engine: do not wait for them


class _Server:
    """The child's request loop around its engine, and its answers (sent whole, one at a time)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.engine: Any = None
        self._send_lock = threading.Lock()
        self._update = _Update()  # the weight update in progress (or the last one)
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def run(self) -> None:
        """Answer requests until `shutdown` or the pipe closes."""
        control: dict[str, Callable[..., Any]] = {
            "pause": self.engine.pause,
            "resume": self.engine.resume,
            "abort": self.engine.abort,
            "healthy": self.engine.healthy,
            "generated_tokens": lambda: self.engine.generated_tokens,
        }
        workers: dict[str, Callable[..., Any]] = {
            "release_memory": self.engine.release_memory,
            "resume_memory": self.engine.resume_memory,
            "score_prompts": self.engine.score_prompts,
        }
        while True:
            try:
                ident, method, args = self.conn.recv()
            except (EOFError, OSError):
                self.engine.shutdown()
                return
            if method == "shutdown":
                self.engine.shutdown()
                self.answer(ident, True, None)
                return
            if method in control:
                self._run(ident, control[method], args)
            elif method == "generate":  # started before the next request is read: an abort after it ends it
                started = threading.Event()
                threading.Thread(target=self._run, args=(ident, self._generate, (started, *args)), daemon=True).start()
                started.wait()
            elif method in workers:
                threading.Thread(target=self._run, args=(ident, workers[method], args), daemon=True).start()
            elif method == "update_begin":
                self._update = _Update()
                threading.Thread(target=self._run_update, args=(self._update, *args), daemon=True).start()
            elif method == "update_bucket":
                buffer, slots = args
                if buffer is not None:
                    self._buffer = buffer
                self._to_update(ident, [(s.name, s.view(self._buffer)) for s in slots])
            elif method == "update_end":
                self._to_update(ident, _END)
            elif method == "update_cancel":
                self._to_update(ident, RuntimeError(*args))
            else:
                self.answer(ident, False, ValueError(f"unknown request {method!r}"))

    def answer(self, ident: int | None, ok: bool, payload: Any) -> None:
        """Send an answer; a failure's `payload` is an exception that went through `_picklable`."""
        if ident is None:
            return
        with self._send_lock:
            try:
                self.conn.send((ident, ok, payload))
            except OSError:  # the parent is gone; the reading loop ends on the closed pipe
                pass

    def _run(self, ident: int | None, fn: Callable[..., Any], args: tuple) -> None:
        try:
            result = fn(*args)
        except BaseException as err:
            self.answer(ident, False, _picklable(err))
        else:
            self.answer(ident, True, result)

    def _generate(self, started: threading.Event, prompts: list[list[int]], params: Any, n: int, routes: bool) -> Any:
        """`LocalEngine.generate`; `started` is set right before it notes the abort count it answers to (a few
        bytecodes later, well within one thread switch interval)."""
        started.set()
        return self.engine.generate(prompts, params, n=n, return_routed_experts=routes)

    def _to_update(self, ident: int, item: Any) -> None:
        """Queue a bucket (or the end) for the update in progress; answer at once if that update has failed."""
        update = self._update
        with update.lock:
            if update.error is None:
                update.queue.put((ident, item))
                return
        self.answer(ident, False, update.error)

    def _run_update(self, update: _Update, version: str) -> None:
        """Feed the streamed buckets to one `update_weights`. A bucket is answered once loaded (the sender may then
        reuse the buffer) and `update_end` with the new version; on failure every request of this update still
        waiting, or arriving later, gets the error."""
        waiting: list[int] = []  # read from the queue, not answered yet

        def buckets() -> Iterator[NamedTensorBucket]:
            while True:
                ident, item = update.queue.get()
                waiting.append(ident)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                self.answer(waiting.pop(), True, None)

        try:
            self.engine.update_weights(buckets(), version)
        except BaseException as err:
            error = _picklable(err)
            with update.lock:
                update.error = error
                while not update.queue.empty():
                    waiting.append(update.queue.get_nowait()[0])
            for ident in waiting:
                self.answer(ident, False, error)
        else:
            self.answer(waiting.pop(), True, self.engine.weight_version)


class _Update:
    """One streamed weight update: its queue of `(id, bucket views | _END | sender's error)` and its failure."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.error: BaseException | None = None


def _picklable(err: BaseException) -> BaseException:
    """`err` with the child's traceback as a note, or a RuntimeError naming it when it cannot be pickled."""
    text = "".join(traceback.format_exception(err))
    try:
        pickle.dumps(err)
    except Exception:
        return RuntimeError(f"in the local engine process: {text}")
    err.add_note(f"raised in the local engine process:\n{text}")
    return err


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the parent is gone (re-parented), even if something else still holds the pipe's other end."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
