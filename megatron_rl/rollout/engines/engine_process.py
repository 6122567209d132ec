"""`ProcessEngine`: the local engine (`LocalEngine`) in a child process, so generation overlaps training on CPU.

The trainer's process and the engine's process share no interpreter: the child (`engine_process_child.serve`,
started with the *spawn* method, never forked from a process with torch threads or gloo) builds a `LocalEngine`
with its own few torch threads and answers requests on one pipe. Semantics are the in-process engine's:

- requests carry ids and may overlap: a producer thread's `generate` runs while the trainer's thread calls
  `update_weights`, `pause`, `resume` or `abort`. The child answers control requests on its reading thread and runs
  `generate`, weight updates and memory calls on worker threads, so `LocalEngine`'s own locking decides the
  interleaving: an update lands between two decode steps, `abort()` ends the calls in progress at their next step
  (partial tokens and log-probs kept), `pause()` holds generation;
- weights travel through one shared-memory buffer (torch's file-descriptor sharing: the segment has no name, so
  nothing can leak) that grows to the largest bucket: a bucket is copied in, the child loads it into its model,
  acknowledges, and the next bucket reuses the buffer;
- a dead child (the pipe closes) or one that does not answer within its timeout fails every call with a
  `RolloutEngineError`; `healthy()` is then False and `recover()` starts a new child from the checkpoint (the
  caller re-sends the weights, as after an SGLang server restart). A child whose parent dies exits (it sees
  the pipe close, or its parent change).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # registers torch's tensor reductions with multiprocessing's pickler

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engine import NamedTensorBucket, RolloutEngineError, ServedScores
from megatron_rl.rollout.engines.engine_process_child import EngineLaunch, TensorSlot, bucket_slots, serve
from megatron_rl.rollout.sample import Sample

logger = logging.getLogger(__name__)

PROCESS_NAME = "local engine process"  # what `recover()` reports restarted


class ProcessEngine:
    """Implements `RolloutEngine` with a `LocalEngine` served by a child process."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        weight_version: str = "default",
        max_batch_size: int = 64,
        stop_on_eos: bool = True,
        torch_threads: int = 1,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
    ):
        """`torch_threads`: the child's intra-op threads (the trainer keeps the others). `request_timeout_s`: the
        longest one `generate` may take; `control_timeout_s`: any other request (a weight bucket, pause, ...);
        `start_timeout_s`: building the child's model. A request past its timeout marks the child unresponsive."""
        if torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {torch_threads}")
        self.launch = EngineLaunch(
            str(model_dir), str(torch.device(device)), weight_version, max_batch_size, stop_on_eos, torch_threads
        )
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.start_timeout_s = start_timeout_s
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._update_lock = threading.Lock()  # one weight update at a time: they share the buffer
        self._closed = False
        self._child = _Child(self.launch, start_timeout_s)
        self._version = weight_version

    @property
    def pid(self) -> int:
        """The child process's id."""
        return self._child.pid

    # ------------------------------------------------------------------ RolloutEngine
    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def generated_tokens(self) -> int:
        """The child engine's running token count (throughput metrics)."""
        return self._call("generated_tokens")

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, return_routed_experts: bool = False
    ) -> list[Sample]:
        """`n` samples per prompt, grouped prompt by prompt (sample i*n+j is prompt i's j-th)."""
        args = (prompts, params, n, return_routed_experts)
        return self._live().request("generate", args, timeout_s=self.request_timeout_s)

    def update_weights(self, buckets: Iterable[NamedTensorBucket], version: str) -> None:
        """Stream HF-named tensors bucket by bucket through the shared buffer; the child loads them as one update
        (atomic w.r.t. decoding; a failure after some tensors loaded leaves it unhealthy, as `LocalEngine`).
        The next bucket is taken from `buckets` while the child loads the previous one, and the end goes out
        without waiting for the last bucket's answer."""
        with self._update_lock:
            child = self._live()
            child.post("update_begin", (version,))
            sent, loading = iter(buckets), None  # loading: the bucket in the buffer, until the child answers
            while (bucket := self._next_bucket(child, sent, loading)) is not None:
                loading = child.submit("update_bucket", bucket)
            end = child.submit("update_end", ())
            if loading is not None:
                child.wait(loading, timeout_s=self.control_timeout_s)
            self._version = child.wait(end, timeout_s=self.control_timeout_s)

    def score_prompts(self, prompts: list[list[int]], top_k: int = 0) -> list[ServedScores]:
        """The child engine's probe scores (`LocalEngine.score_prompts`)."""
        return self._live().request("score_prompts", (prompts, top_k), timeout_s=self.request_timeout_s)

    def release_memory(self, tags: list[str] | None = None) -> None:
        self._call("release_memory", tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._call("resume_memory", tags)

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def abort(self) -> None:
        """End every generate call in progress at its next step; their samples get finish_reason "abort"."""
        self._call("abort")

    def healthy(self) -> bool:
        """The child is alive, answers within `control_timeout_s`, and its engine holds consistent weights."""
        if self._closed or not self._child.alive:
            return False
        try:
            return self._call("healthy")
        except RolloutEngineError:
            return False

    def recover(self) -> list[str]:
        """Start a new child if this one died or stopped answering; it serves the checkpoint again (weight version
        reset): the caller re-sends the current weights. Mixed weights in a live child are repaired by that
        update alone."""
        self._check_open()
        if self._child.alive:
            try:
                self._call("healthy")
                return []
            except RolloutEngineError:
                pass
        logger.warning("restarting the %s (%s)", PROCESS_NAME, self._child.failure or "unresponsive")
        self._child.stop(timeout_s=0)
        self._child = _Child(self.launch, self.start_timeout_s)
        self._version = self.launch.weight_version
        return [PROCESS_NAME]

    def shutdown(self) -> None:
        """Stop the child (its engine aborts calls in flight) and reap it; later calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self._child.stop(timeout_s=self.control_timeout_s)
        self._buffer = torch.empty(0, dtype=torch.uint8)

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: str, *args: Any) -> Any:
        return self._live().request(method, args, timeout_s=self.control_timeout_s)

    def _live(self) -> _Child:
        self._check_open()
        return self._child

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ProcessEngine was shut down")

    def _next_bucket(
        self, child: _Child, buckets: Iterator[NamedTensorBucket], loading: _Request | None
    ) -> tuple[torch.Tensor | None, list[TensorSlot]] | None:
        """Copy the next bucket into the shared buffer once the child has loaded the one there (`loading`):
        (the buffer if the child has not seen it yet, the slots), or None after the last one. When the sender's
        buckets fail, the child ends its update first (it then reports unhealthy if tensors were loaded, as
        `LocalEngine`) and the sender's error is raised."""
        try:
            bucket = next(buckets, None)
        except BaseException as err:
            self._cancel_update(child, err)
            raise
        if bucket is None:
            return None
        if loading is not None:
            child.wait(loading, timeout_s=self.control_timeout_s)  # the child's failure raises here
        try:
            slots = bucket_slots(bucket)
            grown = self._fit_buffer(child, slots[-1].offset + slots[-1].nbytes if slots else 0)
            for slot, (_, tensor) in zip(slots, bucket, strict=True):
                slot.view(self._buffer).copy_(tensor)
        except BaseException as err:
            self._cancel_update(child, err)
            raise
        return grown, slots

    def _cancel_update(self, child: _Child, err: BaseException) -> None:
        message = f"the weight buckets failed in the trainer: {type(err).__name__}: {err}"
        with contextlib.suppress(RuntimeError):  # the answer is that error (or the child's own failure)
            child.request("update_cancel", (message,), timeout_s=self.control_timeout_s)

    def _fit_buffer(self, child: _Child, nbytes: int) -> torch.Tensor | None:
        """The shared buffer holds `nbytes`; returns it when the child has not seen this buffer yet."""
        if nbytes > self._buffer.numel():
            self._buffer = torch.empty(max(nbytes, 2 * self._buffer.numel()), dtype=torch.uint8).share_memory_()
        if child.buffer_sent is self._buffer:
            return None
        child.buffer_sent = self._buffer
        return self._buffer


@dataclass(frozen=True)
class _Request:
    """A request sent to the child, whose answer its future holds."""

    ident: int
    method: str
    future: Future


class _Child:
    """One child process and the pipe to it: requests go out with ids, a receiving thread resolves their futures;
    the pipe closing (the child died) or a request's timeout fails them with `RolloutEngineError`."""

    def __init__(self, launch: EngineLaunch, start_timeout_s: float):
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=serve, args=(child_conn, launch, os.getpid()), name="megatron-rl-local-engine", daemon=True
        )
        self.process.start()
        child_conn.close()  # the child holds the only other end: its death closes the pipe
        self.failure: str | None = None  # why it can no longer serve (dead, unresponsive)
        self.buffer_sent: torch.Tensor | None = None
        self._stopping = False
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {0: Future()}  # 0: the start-up answer
        self._lock = threading.Lock()  # the pending table
        self._send_lock = threading.Lock()  # apart: the receiver never waits for a send (the pipe may be full)
        self._receiver = threading.Thread(target=self._receive, name="engine-process-receiver", daemon=True)
        self._receiver.start()
        try:
            self.wait(_Request(0, "start", self._pending[0]), timeout_s=start_timeout_s)
        except BaseException:
            self.stop(timeout_s=0)
            raise

    @property
    def pid(self) -> int:
        assert self.process.pid is not None  # started in __init__
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Running, and it has answered every request within its timeout."""
        return self.failure is None and self.process.is_alive()

    def post(self, method: str, args: tuple) -> None:
        """Send a request nobody waits for (its failure shows in the next request's answer)."""
        self._send(None, method, args)

    def request(self, method: str, args: tuple, *, timeout_s: float) -> Any:
        return self.wait(self.submit(method, args), timeout_s=timeout_s)

    def submit(self, method: str, args: tuple) -> _Request:
        """Send a request; `wait` for its answer."""
        request = _Request(next(self._ids), method, Future())
        with self._lock:
            self._pending[request.ident] = request.future
        try:
            self._send(request.ident, method, args)
        except RolloutEngineError:
            with self._lock:
                self._pending.pop(request.ident, None)
            raise
        return request

    def wait(self, request: _Request, *, timeout_s: float) -> Any:
        """The answer to `request`, or its error raised here (a `RolloutEngineError` when the child died or did
        not answer within `timeout_s`)."""
        try:
            ok, payload = request.future.result(timeout_s)
        except FutureTimeout:
            self._fail(
                RolloutEngineError(
                    f"the {PROCESS_NAME} (pid {self.pid}) did not answer {request.method!r} within {timeout_s:g} s: "
                    "recover() restarts it"
                )
            )
            ok, payload = request.future.result()
        if not ok:
            raise payload
        return payload

    def stop(self, *, timeout_s: float) -> None:
        """Ask the child to shut down (when `timeout_s` > 0 and it is alive), kill it if it has not, reap it."""
        self._stopping = True
        if timeout_s > 0 and self.alive:
            try:
                self.request("shutdown", (), timeout_s=timeout_s)
            except RolloutEngineError:
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self._receiver.join()  # it sees the pipe close
        self.conn.close()
        self.process.close()

    def _send(self, ident: int | None, method: str, args: tuple) -> None:
        if self.failure is not None:
            raise RolloutEngineError(self.failure)
        try:
            with self._send_lock:
                self.conn.send((ident, method, args))
        except OSError as err:
            raise RolloutEngineError(self._died()) from err

    def _receive(self) -> None:
        """Resolve answers until the pipe closes; then fail whatever still waits."""
        try:
            while True:
                ident, ok, payload = self.conn.recv()
                with self._lock:
                    future = self._pending.pop(ident, None)
                if future is not None:
                    future.set_result((ok, payload))
        except (EOFError, OSError):
            pass
        self._fail(RuntimeError("ProcessEngine was shut down") if self._stopping else RolloutEngineError(self._died()))

    def _fail(self, error: Exception) -> None:
        """No more answers will come (the child died or stopped answering): every waiting call raises `error`."""
        if self.failure is None:
            self.failure = str(error)
        with self._lock:
            waiting, self._pending = list(self._pending.values()), {}
        for future in waiting:
            future.set_result((False, error))

    def _died(self) -> str:
        if self.failure is None:
            self.process.join(timeout=5)  # the pipe closes a moment before the exit code is known
            code = self.process.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            self.failure = f"the {PROCESS_NAME} (pid {self.pid}) {how}: recover() restarts it"
        return self.failure
