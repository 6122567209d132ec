"""The writer thread of a background checkpoint save (`checkpoint.BackgroundSaves`), built from Megatron's pieces.

Megatron's own async save forks a writer process per save (its snapshot: copy-on-write host memory; its persistent
worker shares host tensors instead) and leaves the plan, the gather of every rank's write results and `.metadata`
to the training thread. Here the training thread only takes a snapshot (`HostSnapshot`) and the thread does the rest
with Megatron's functions: `dist_checkpointing.save` of the snapshot (its planning is local once the cached plan is
validated; before that it runs on the training thread, whose collectives it needs), the files one after the other
(`FileSystemWriterAsync.write_preloaded_data`; 0.16.x's request would fork a process per file, 0.19.x starts
threads), then, over the writer's own process group so that no collective interleaves with training's on the same
group, the gather of the write results, `.metadata` and `metadata.json`, and the caller's publish step.

Imported on first use by `checkpoint` (it imports Megatron, which must come after `platform.bridge_cpu`).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.utils import _get_failure_dict, _wrap_exception

from megatron_rl.megatron_backend import platform


class HostSnapshot:
    """The data of a sharded state dict, copied now into host buffers that the next snapshot reuses.

    `take` replaces in place the data of every ShardedTensor and ShardedTensorFactory and every plain tensor with a
    copy in a host buffer (pinned, and copied asynchronously, when the source is on a GPU: `wait_copied` waits for
    those copies), and every other value (the ShardedObjects' data: optimizer param groups, bucket sizes) with a deep
    copy; LocalNonpersistentObjects are left alone (they are not saved). Buffers are matched to tensors by their
    position in the state's traversal order, which is the same at every save of a run (a tensor whose shape or dtype
    differs from its buffer's gets a new buffer)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._copied: platform.CopyDone | None = None

    def take(self, state: dict) -> dict:
        """Snapshot `state` in place (and return it); device copies are queued on the current stream."""
        position = 0
        on_device = False

        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal position, on_device
            tensor = tensor.detach()
            if position == len(self._buffers):
                self._buffers.append(torch.empty(0))
            buffer = self._buffers[position]
            if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = platform.empty_host(tensor.shape, tensor.dtype, pinned=tensor.is_cuda)
                self._buffers[position] = buffer
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)
            on_device |= tensor.is_cuda
            position += 1
            return buffer

        def snapshot(value: Any) -> Any:
            if isinstance(value, ShardedTensor | ShardedTensorFactory):
                value.data = to_host(value.data)
            elif isinstance(value, ShardedObject):
                value.data = copy.deepcopy(value.data)
            elif isinstance(value, LocalNonpersistentObject):
                return value  # not saved
            elif torch.is_tensor(value):
                return to_host(value)
            else:
                return copy.deepcopy(value)
            return value

        dict_list_map_inplace(snapshot, state)
        del self._buffers[position:]
        self._copied = None
        if on_device:
            self._copied = platform.CopyDone()
        return state

    def wait_copied(self) -> None:
        """Block until the snapshot's device-to-host copies have landed (at once on a CPU-only state)."""
        if self._copied is not None:
            self._copied.wait()


class PlanKeepingStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save strategy with a cached save plan (`cached_metadata`), which also keeps the last
    save's writer and global metadata (the coordinator's; None elsewhere) for a finalize step run elsewhere."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, cached_metadata=True)
        self.writer: FileSystemWriterAsync | None = None
        self.global_metadata: Any = None

    def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any, *args: Any) -> Any:
        self.writer, self.global_metadata = writer, save_state_dict_ret[1]
        return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, *args)

    def plans_locally(self) -> bool:
        """Whether the next save's planning needs no collective: the cached plan was validated by a later save."""
        return bool(self.validated_cache_reuse) and self.cached_central_plan is not None


class WriterThread:
    """A daemon thread that runs the jobs given to it one after the other until `stop` (starting a thread per save
    costs the training thread a hand-over of the interpreter lock each time)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # The thread works on this rank's GPU, if any (a new thread starts on device 0: its CUDA calls, the wait for
        # the snapshot's copies included, must not create a context on another rank's device).
        self._device = platform.current_accelerator_index()
        self._thread = threading.Thread(target=self._serve, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def stop(self, *, join: bool = False) -> None:
        """End the thread once the jobs queued before have run (`join`: and wait for it)."""
        self._jobs.put(None)
        if join and self._thread is not threading.current_thread():
            self._thread.join()

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Queue `job` (it must not raise); the event is set when it has run."""
        done = threading.Event()

        def run() -> None:
            try:
                job()
            finally:
                done.set()

        self._jobs.put(run)
        return done

    def _serve(self) -> None:
        if self._device is not None:
            platform.set_current_accelerator(self._device)
        while (job := self._jobs.get()) is not None:
            job()


class BackgroundWrite:
    """One save written by the writer thread: see the module docstring. `error` is what ended it early (on every
    rank)."""

    def __init__(
        self, strategy: PlanKeepingStrategy, group: dist.ProcessGroup, snapshot: HostSnapshot, thread: WriterThread
    ) -> None:
        self._strategy, self._group, self._snapshot, self._thread = strategy, group, snapshot, thread
        self.error: BaseException | None = None
        self._done: threading.Event | None = None

    def start(
        self,
        state: dict,
        directory: Path,
        options: dict[str, Any],
        write_files: Callable[[], None],
        publish: Callable[[dist.ProcessGroup], None],
    ) -> None:
        """Collective on the first saves of a run (their planning runs here): snapshot `state` and start the thread
        that saves it to `directory` (`dist_checkpointing.save` with `options`), then runs `write_files` (the small
        state files) and `publish(group)` once every rank's files are written."""
        self._snapshot.take(state)
        request = None
        if not self._strategy.plans_locally():
            self._snapshot.wait_copied()
            request = dist_checkpointing.save(state, str(directory), **options)

        def run() -> None:
            try:
                outcome: Any = self._write(request, state, directory, options)
                write_files()
            except BaseException as err:  # noqa: BLE001 - every rank learns of it in the gather
                outcome = _wrap_exception(err)
            try:
                self._finalize(outcome, directory)
                publish(self._group)
            except BaseException as err:  # noqa: BLE001 - raised again by join(), on the training thread
                self.error = err

        self._done = self._thread.submit(run)

    def join(self) -> None:
        """Wait until the save is written and published; raise what ended it early."""
        if self._done is not None:
            self._done.wait()
        if self.error is not None:
            raise self.error

    def _write(self, request: Any, state: dict, directory: Path, options: dict[str, Any]) -> list:
        """Plan (if not planned yet) and write this rank's files; their write results."""
        if request is None:
            self._snapshot.wait_copied()
            request = dist_checkpointing.save(state, str(directory), **options)
        if request.async_fn is None:
            return []  # nothing to write on this rank
        transforms = request.async_fn.args[0]  # partial(write_preloaded_data_multi{proc,thread}, transforms, msc)
        _rank, buckets, _results_queue = request.async_fn_args
        written: queue.Queue = queue.Queue()
        done: queue.Queue = queue.Queue()
        results: list = []
        for index, bucket in enumerate(buckets):
            done.put(index)
            FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, written, done, True)
            _index, result = written.get()
            if isinstance(result, Exception):
                raise result
            results += result
        return results

    def _finalize(self, outcome: Any, directory: Path) -> None:
        """Collective over the writer group: Megatron's finalize step (`save_state_dict_async_finalize` and the
        `metadata.json` of `dist_checkpointing.save`): gather every rank's write results; if none failed the
        coordinator writes `.metadata`; every rank raises CheckpointException if any failed."""
        coordinator = dist.get_rank(self._group) == 0
        outcomes: list | None = [None] * dist.get_world_size(self._group) if coordinator else None
        dist.gather_object(outcome, outcomes, dst=dist.get_global_rank(self._group, 0), group=self._group)
        failures = _get_failure_dict(outcomes) if outcomes is not None else {}
        if coordinator and not failures:
            assert self._strategy.writer is not None
            self._strategy.writer.finish(self._strategy.global_metadata, outcomes)
            save_config(CheckpointingConfig(self._strategy.backend, self._strategy.version), str(directory))
        failed = [bool(failures)]
        dist.broadcast_object_list(failed, src=dist.get_global_rank(self._group, 0), group=self._group)
        if failed[0]:
            raise CheckpointException("write", failures)
