"""Megatron distributed checkpoints of the actor: model, optimizer, LR schedule, RNG and trainer state.

The directory layout, the state files and the atomic publish are `checkpoint_format`'s.

A save writes everything under a temporary name and renames it when every rank has finished, so a
crash mid-save leaves the previous checkpoint as `latest`; a background save (`BackgroundSaves`) is renamed by
its writer thread once every rank's files are written, and the next save waits for it. Model weights reshard
to any TP/EP/PP layout (Megatron's sharded tensors carry global keys); the distributed optimizer's state uses
the `dp_reshardable` format, which reshards across data-parallel sizes only.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import functools
import os
import resource
import shutil
import signal
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.formats.checkpoint_format import (
    COMPLETE,
    HF_CONFIG,
    MEGATRON_DIR,
    RNG_DIR,
    CheckpointError,
    error_summary,
    fresh_staging_dir,
    is_complete,
    latest_checkpoint,
    publish_checkpoint,
    read_checkpoint_json,
    read_trainer_state,
    remove_stale_staging,
    rng_file,
    scan_checkpoints,
    staging_dir,
    step_dir_name,
    write_hf_config,
    write_latest,
    write_trainer_state,
)
from megatron_rl.formats.checkpoint_format import CheckpointScan as CheckpointScan  # re-exported
from megatron_rl.formats.checkpoint_format import read_checkpoint_hf_config as read_checkpoint_hf_config
from megatron_rl.formats.checkpoint_format import resolve_checkpoint_dir as resolve_checkpoint_dir
from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.checkpoint.dist_checkpoint_files import check_checkpoint_files
from megatron_rl.megatron_backend.checkpoint.model_state import (
    CRITIC,
    restore_trained_state,
    trained_fields,
    trained_state,
)
from megatron_rl.megatron_backend.checkpoint.rng_state_file import read_rng_state
from megatron_rl.megatron_backend.platform import mcore_compat
from megatron_rl.models.architecture import check_same_architecture


def _sharding_metadata() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "distrib_optim_sharding_type": "dp_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    accelerator = platform.accelerator_rng_state()
    if accelerator is not None:
        state["cuda"] = accelerator
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    platform.set_accelerator_rng_state(state.get("cuda"))


_OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # full device, quota, file-size limit (RLIMIT_FSIZE)


def _out_of_space(err: BaseException, tmp: Path) -> str | None:
    """The reason ("No space left on device", ...) if a full disk is behind `err`, a failed save into `tmp`.
    Megatron's writer runs in worker processes and torch.distributed.checkpoint gathers their errors by
    pickling, which drops the `OSError` cause: only the message survives, and torch's zip writer reports a
    short write with no reason at all ("unexpected pos ..."); then the disk itself is asked."""
    seen: set[int] = set()
    todo: list[object] = [err]  # exceptions, and whatever their args, causes and failures hold
    while todo:
        e = todo.pop()
        if isinstance(e, tuple | list):  # a failure may come as (exception, traceback)
            todo += e
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _OUT_OF_SPACE:
            return e.strerror
        reason = next((os.strerror(code) for code in _OUT_OF_SPACE if os.strerror(code) in str(e)), None)
        if reason is not None:
            return reason
        failures = getattr(e, "failures", None)
        todo += [e.__cause__, e.__context__, *e.args, *(failures.values() if isinstance(failures, dict) else ())]
    if tmp.exists() and shutil.disk_usage(tmp).free < 1 << 20:
        return os.strerror(errno.ENOSPC)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and any(f.stat().st_size >= limit for f in tmp.rglob("*") if f.is_file()):
        return f"{os.strerror(errno.EFBIG)}: the file-size limit (ulimit -f) is {limit} bytes"
    return None


def _out_of_space_error(err: BaseException, root: Path, step: int) -> CheckpointError | None:
    """The one-line error for a save of `step` under `root` that failed for want of space, after removing the
    partial save (the previous checkpoint stays `latest`); None if a full disk is not behind `err`."""
    tmp = staging_dir(root / step_dir_name(step))
    reason = _out_of_space(err, tmp)
    if reason is None:
        return None
    shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_checkpoint(root)
    return CheckpointError(
        f"no space left for checkpoint {step_dir_name(step)} in {root} ({reason}); the partial save "
        f"was removed and the latest checkpoint is still {previous.name if previous else 'none'}: free space "
        "(or set trainer.output_dir elsewhere) and resume with trainer.resume=auto"
    )


def _reports_out_of_space(save):
    """`save_checkpoint` that turns a full disk into one line naming the folder, after removing the partial save
    (the previous checkpoint stays `latest`), instead of a traceback from deep inside the writer."""

    @functools.wraps(save)
    def save_or_report(actor: MegatronActor, root: str | Path, step: int, *args, **kwargs) -> Path:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            return save(actor, root, step, *args, **kwargs)
        except CheckpointError:
            raise  # already the one line (a background save in flight that failed, reported by its wait)
        except (Exception, CheckpointException) as err:
            report = _out_of_space_error(err, Path(root), step)
            if report is None:
                raise
            raise report from err

    return save_or_report


class BackgroundSaves:
    """Checkpoints written by a writer thread while training goes on, at most one at a time.

    A save builds the sharded state dict, snapshots it into host buffers reused from save to save (on a GPU: the
    one device-to-host copy) and hands the rest to a thread (`background_writer`): Megatron's dist_checkpointing
    save of the snapshot, the RNG and trainer state files, then, over the writer's own gloo process group, the
    gather of every rank's write results, `.metadata`, and the publish (`COMPLETE` last, rename, `latest`,
    pruning). The first saves of a run plan on the training thread (the save plan is gathered from every rank until
    the cached plan is validated, at the second save). `wait`, which the next save calls first, joins the thread.
    A crash before the publish leaves only the staging folder, so the previous checkpoint stays `latest`.
    """

    def __init__(self) -> None:
        from megatron_rl.megatron_backend.checkpoint import background_writer

        self._writer = background_writer
        self._snapshot = background_writer.HostSnapshot()
        # One strategy for every save, caching the save plan: while the state's structure does not change (it does
        # not within a run), later saves skip the gather of every rank's plan and the global metadata exchange.
        self.strategy = background_writer.PlanKeepingStrategy()
        self._group = dist.new_group(backend="gloo")  # collective: every rank builds its BackgroundSaves together
        self._thread = background_writer.WriterThread()
        weakref.finalize(self, self._thread.stop)
        self._in_flight: tuple[Any, _Publish] | None = None
        self.published: int | None = None  # the step of the newest checkpoint this object published
        self.saves = 0

    def start(self, state: dict, directory: Path, write_files: Callable[[], None], publish: _Publish) -> None:
        """Collective: snapshot `state` (a sharded state dict) and write it to `directory` in the background, then
        `write_files` (the small state files) and `publish`."""
        from megatron.core import dist_checkpointing

        if self._in_flight is not None:
            raise RuntimeError("a checkpoint save is still in flight: wait() for it first")
        write = self._writer.BackgroundWrite(self.strategy, self._group, self._snapshot, self._thread)
        write.start(state, directory, _background_save_options(dist_checkpointing.save, self), write_files, publish)
        self._in_flight = (write, publish)

    def close(self) -> int | None:
        """Collective: `wait`, then end the writer thread (before the process groups go: a thread left to the
        interpreter's exit can abort the process there). Returns what `wait` returns."""
        try:
            return self.wait()
        finally:
            self._thread.stop(join=True)

    def wait(self) -> int | None:
        """Collective: wait until the save in flight is written and published; its step (None if none was)."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        if self._in_flight is None:
            return None
        write, publish = self._in_flight
        self._in_flight = None
        try:
            write.join()
        except (Exception, CheckpointException) as err:
            report = _out_of_space_error(err, publish.root, publish.step)
            if report is None:
                raise
            raise report from err
        self.published = publish.step
        return self.published


def start_checkpoint_writer() -> None:
    """Start the helper process Megatron's checkpoint writer keeps for the life of the process now, with SIGINT and
    SIGTERM ignored (it inherits the dispositions).

    A signal to the whole process group (Ctrl-C in a terminal, SLURM's scancel) would otherwise kill it, and the
    trainer, which stops at the next step boundary and saves that step, would find its writer gone (a broken pipe).
    It still ends with the trainer (the Manager's finaliser) and on SIGKILL. Call before installing signal handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        platform.checkpoint_writer_results_queue()
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        platform.checkpoint_writer_results_queue()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@_reports_out_of_space
def save_checkpoint(
    actor: MegatronActor,
    root: str | Path,
    step: int,
    trainer_state: dict,
    *,
    keep_last: int = 2,
    run_id: str | None = None,
    background: BackgroundSaves | None = None,
    critic: MegatronActor | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory. With `critic` (PPO's value model) its
    weights, optimizer and schedule are in the same checkpoint (`model_state`).

    `run_id` is recorded in trainer_state.json; pruning to `keep_last` only removes checkpoints of the same run
    id (never another run's, never the one `latest` names). With `background` the state is snapshotted now and
    written by a thread, and the checkpoint is published by `background.wait()` (which this function calls
    first: a save waits for the previous one)."""
    from megatron.core import dist_checkpointing

    if background is not None:
        background.wait()
    root = Path(root)
    rank = dist.get_rank()
    final = root / step_dir_name(step)
    tmp = staging_dir(final)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(root)
        fresh_staging_dir(final)
        (tmp / MEGATRON_DIR).mkdir()
        (tmp / RNG_DIR).mkdir()
    dist.barrier()
    metadata = _sharding_metadata()
    state = trained_state(actor, metadata, is_loading=False)
    if critic is not None:
        state.update(trained_state(critic, metadata, name=CRITIC, is_loading=False))
    trainer_fields = None
    if rank == 0:
        fields = trained_fields(actor)
        trainer_fields = {
            "step": step,
            "actor_step": fields["step"],
            "scheduler": fields["scheduler"],
            "adam_steps": fields["adam_steps"],
            "trainer": trainer_state,
            "world_size": dist.get_world_size(),
            "run_id": run_id,
            **({CRITIC: trained_fields(critic)} if critic is not None else {}),
        }
    small_files = _SmallFiles(tmp, rank, _rng_state(), trainer_fields, actor.hf_config)
    publish = _Publish(root, step, keep_last, run_id)
    if background is None:
        dist_checkpointing.save(state, str(tmp / MEGATRON_DIR))
        small_files()
        publish()
    else:
        background.start(state, tmp / MEGATRON_DIR, copy.deepcopy(small_files), publish)
    return final


@dataclasses.dataclass
class _SmallFiles:
    """The state files next to Megatron's: each rank's RNG state; on rank 0 trainer_state.json and the HF config."""

    checkpoint: Path
    rank: int
    rng: dict[str, Any]
    trainer: dict[str, Any] | None
    hf_config: dict

    def __call__(self) -> None:
        torch.save(self.rng, rng_file(self.checkpoint, self.rank))
        if self.trainer is not None:
            write_trainer_state(self.checkpoint, **self.trainer)
            write_hf_config(self.checkpoint, self.hf_config)


def _background_save_options(save: Any, background: BackgroundSaves) -> dict[str, Any]:
    """`dist_checkpointing.save`'s options for a background save: a request for Megatron's own writer (0.19.x
    defaults to NVIDIA Resiliency Extension's, `async_strategy="nvrx"`, not a dependency of ours) and the run's
    cached save plan; the state's sharding is validated on the run's first save only."""
    options: dict[str, Any] = {
        "async_sharded_save": True,
        "sharded_strategy": background.strategy,
        "validate_access_integrity": background.saves == 0,
    }
    background.saves += 1
    if mcore_compat.save_takes_async_strategy(save):
        options["async_strategy"] = "mcore"
    return options


@dataclasses.dataclass
class _Publish:
    """Collective (over `group`, the default one if None): once every rank has written its part of `step`'s staging
    folder, mark it complete, rename it, point `latest` at it and prune."""

    root: Path
    step: int
    keep_last: int
    run_id: str | None

    def __call__(self, group: dist.ProcessGroup | None = None) -> None:
        final = self.root / step_dir_name(self.step)
        dist.barrier(group=group)
        if dist.get_rank() == 0:
            publish_checkpoint(staging_dir(final), final, overwrite=True)
            write_latest(self.root, final)
            prune_checkpoints(self.root, self.keep_last, self.run_id)
        dist.barrier(group=group)


def load_checkpoint(
    actor: MegatronActor, path: str | Path, *, load_optimizer: bool = True, critic: MegatronActor | None = None
) -> dict:
    """Collective. Restores model (any layout), optimizer + scheduler + RNG (same layout), and with `critic` the
    critic's (saved with the actor's); returns trainer state."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    check_checkpoint_files(path)  # a missing or truncated file is named before Megatron reads anything
    saved = read_trainer_state(path)
    if (path / HF_CONFIG).is_file():
        check_same_architecture(actor.hf_config, read_checkpoint_json(path, HF_CONFIG), path)
    if critic is not None and CRITIC not in saved:
        raise CheckpointError(
            f"{path} holds no critic (it was saved by a run without algo.advantage=gae); resume it with the advantage "
            "estimator it was trained with, or start a new run"
        )
    metadata = _sharding_metadata()
    with_optimizer = load_optimizer and actor.optimizer is not None
    state = trained_state(actor, metadata, is_loading=True, with_optimizer=with_optimizer)
    if critic is not None:
        state.update(trained_state(critic, metadata, name=CRITIC, is_loading=True, with_optimizer=load_optimizer))
    try:
        loaded = dist_checkpointing.load(state, str(path / MEGATRON_DIR))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised with the checkpoint named
        raise CheckpointError(
            f"cannot load {path}: {error_summary(err)} (its files are all present at the sizes "
            "megatron/.metadata records: a file is corrupt inside, or the checkpoint was saved with other "
            "model options); resume from an older checkpoint or re-save it"
        ) from err
    actor_fields = {**saved, "step": saved.get("actor_step", saved["step"])}
    restore_trained_state(actor, loaded, actor_fields, with_optimizer=with_optimizer)
    if critic is not None:
        with_critic_optimizer = load_optimizer and critic.optimizer is not None
        restore_trained_state(critic, loaded, saved[CRITIC], name=CRITIC, with_optimizer=with_critic_optimizer)
    rng = rng_file(path, dist.get_rank())
    if rng.is_file() and saved.get("world_size") == dist.get_world_size():
        _set_rng_state(read_rng_state(path, rng))
    return saved["trainer"]


def prune_checkpoints(root: Path, keep_last: int, run_id: str | None) -> None:
    """Remove all but the newest `keep_last` complete checkpoints written by run `run_id`; checkpoints of other
    runs (or unreadable ones) and the one `latest` names are never removed."""
    scan = scan_checkpoints(root)

    def written_by_this_run(path: Path) -> bool:
        try:
            return read_trainer_state(path).get("run_id") == run_id
        except CheckpointError:
            return False

    ours = [p for p in scan.complete if written_by_this_run(p)]
    for old in ours[: max(len(ours) - keep_last, 0)]:
        if old != scan.latest:
            shutil.rmtree(old, ignore_errors=True)
