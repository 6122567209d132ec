"""Pushing trainer weights into SGLang servers: the three paths, client side (reference/sglang.md §3.2).

Input everywhere: an iterable of buckets `list[(hf_name, full_tensor)]`, e.g.
`MegatronActor.export_hf(bucket_bytes=...)`.

- `tensor`: `/begin_weight_update` → one `/update_weights_from_tensor` per bucket, whose payload is a base64 pickle
  of the bucket's CPU tensors *by value* (works across unrelated processes and machines; one copy per server TP
  rank) → `/end_weight_update`. Simple, but every byte goes through JSON/HTTP.
- `distributed`: a process group between the trainer (rank 0) and every server TP rank (`/init_weights_update_group`,
  gloo on CPU, nccl on GPU); per bucket, `/update_weights_from_distributed` (names/dtypes/shapes) runs in a thread
  while rank 0 broadcasts each tensor in the same order. Also wrapped in begin/end_weight_update.
- `disk`: HF safetensors shards (+ index and the non-weight files of the served checkpoint) written to a directory
  the servers can read, then `/update_weights_from_disk`.

Every path ends with the new `weight_version` on the servers and a flushed prefix cache; `update()` returns a
`SyncReport` (bytes, seconds). `check_weights_arrived()` compares served log-probs of a probe with expected ones.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch

from megatron_rl.rollout.sglang_server import SGLangServerError, free_port, request_json

logger = logging.getLogger(__name__)

NamedTensorBucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SyncReport:
    path: str
    tensors: int
    buckets: int
    bytes: int  # tensor bytes sent once (per server copies not counted)
    seconds: float

    def __str__(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9) / 2**20
        return (
            f"{self.path}: {self.tensors} tensors in {self.buckets} buckets, {self.bytes / 2**20:.2f} MiB "
            f"in {self.seconds:.2f} s ({rate:.1f} MiB/s)"
        )


class WeightSync(Protocol):
    def update(
        self, urls: list[str], buckets: Iterable[NamedTensorBucket], version: str, *, timeout_s: float
    ) -> SyncReport: ...

    def reset(self, live_urls: list[str]) -> None:
        """Forget per-server state after a server restart (`live_urls`: the servers that kept running)."""
        ...


def make_weight_sync(path: str, *, tp_size: int = 1, master_address: str = "127.0.0.1") -> WeightSync:
    """A strategy by name: "tensor", "distributed" or "disk"; `tp_size` = GPUs (TP ranks) per server,
    `master_address` = where the servers reach this process for the distributed broadcast group."""
    if path == "tensor":
        return TensorWeightSync(tp_size=tp_size)
    if path == "distributed":
        return DistributedWeightSync(master_address=master_address, tp_size=tp_size)
    if path == "disk":
        return DiskWeightSync()
    raise ValueError(f"unknown weight-sync path {path!r}; expected 'tensor', 'distributed' or 'disk'")


def split_expert_buckets(buckets: Iterable[NamedTensorBucket]) -> Iterable[NamedTensorBucket]:
    """Put each bucket's routed-expert tensors (`.mlp.experts.`) into a bucket of their own (order kept)."""
    for bucket in buckets:
        dense = [(n, t) for n, t in bucket if ".experts." not in n]
        experts = [(n, t) for n, t in bucket if ".experts." in n]
        yield from (b for b in (dense, experts) if b)


def _nbytes(bucket: NamedTensorBucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def _each(urls: list[str], fn: Callable[[str], object]) -> list:
    """`fn(url)` for every server concurrently; the first error is raised after all have finished."""
    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        futures = [pool.submit(fn, u) for u in urls]
    return [f.result() for f in futures]


def _finish(urls: list[str], version: str, timeout_s: float) -> None:
    _each(urls, lambda u: request_json(u, "/flush_cache", {}, timeout_s=timeout_s))
    _each(
        urls,
        lambda u: request_json(
            u, "/update_weight_version", {"new_version": version, "abort_all_requests": False}, timeout_s=timeout_s
        ),
    )


def _check_success(url: str, path: str, answer: object) -> None:
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SGLangServerError(f"SGLang {url}{path} failed: {answer.get('message')}")


class _Session:
    """`/begin_weight_update` … `/end_weight_update` on every server (mandatory since SGLang 0.5.22)."""

    def __init__(self, urls: list[str], timeout_s: float):
        self.urls, self.timeout_s = urls, timeout_s

    def __enter__(self) -> _Session:
        _each(
            self.urls, lambda u: request_json(u, "/begin_weight_update", {"selector": "all"}, timeout_s=self.timeout_s)
        )
        return self

    def __exit__(self, *exc) -> None:
        try:
            _each(self.urls, lambda u: request_json(u, "/end_weight_update", {}, timeout_s=self.timeout_s))
        except SGLangServerError:
            if exc[0] is None:
                raise
            logger.exception("end_weight_update failed after an earlier error")


# ---------------------------------------------------------------------------------------------- tensor
@dataclass
class TensorWeightSync:
    """`/update_weights_from_tensor` with by-value pickles, one payload copy per server TP rank."""

    tp_size: int = 1
    split_experts: bool = True

    def reset(self, live_urls: list[str]) -> None:
        """Stateless between updates: nothing to forget after a server restart."""

    def update(
        self, urls: list[str], buckets: Iterable[NamedTensorBucket], version: str, *, timeout_s: float
    ) -> SyncReport:
        start, tensors, count, nbytes = time.perf_counter(), 0, 0, 0
        if self.split_experts:
            buckets = split_expert_buckets(buckets)
        with _Session(urls, timeout_s):
            for bucket in buckets:
                payload = serialize_bucket(bucket)
                body = {
                    "serialized_named_tensors": [payload] * self.tp_size,
                    "flush_cache": False,
                    "weight_version": version,
                }

                def send(url: str, body=body) -> None:
                    _check_success(
                        url,
                        "/update_weights_from_tensor",
                        request_json(url, "/update_weights_from_tensor", body, timeout_s=timeout_s),
                    )

                _each(urls, send)
                tensors, count, nbytes = tensors + len(bucket), count + 1, nbytes + _nbytes(bucket)
        _finish(urls, version, timeout_s)
        return SyncReport("tensor", tensors, count, nbytes, time.perf_counter() - start)


def serialize_bucket(bucket: NamedTensorBucket) -> str:
    """Base64 pickle of `[(name, contiguous cpu tensor)]`, tensors by value (SGLang's SafeUnpickler accepts it)."""
    cpu = [(name, t.detach().to("cpu").contiguous()) for name, t in bucket]
    return base64.b64encode(pickle.dumps(cpu, protocol=pickle.HIGHEST_PROTOCOL)).decode()


# ---------------------------------------------------------------------------------------------- distributed
@dataclass
class DistributedWeightSync:
    """Broadcast from the trainer (rank 0 of a dedicated group) to every server TP rank."""

    backend: str = ""  # "" = nccl when CUDA is available, else gloo
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0 = a free port
    tp_size: int = 1  # TP ranks per server (engine rank = 1 + server index * tp_size + tp rank)
    group_name: str = "megatron_rl_weight_update"
    init_timeout_s: float = 120.0
    split_experts: bool = True

    def __post_init__(self) -> None:
        self._group = None
        self._urls: list[str] | None = None
        self._device = torch.device("cpu")

    def connect(self, urls: list[str], timeout_s: float) -> None:
        """Create the group: every server joins via HTTP while this process joins as rank 0."""
        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        port = self.master_port or free_port(self.master_address)
        world_size = 1 + len(urls) * self.tp_size
        with ThreadPoolExecutor(max(1, len(urls))) as pool:
            futures = [
                pool.submit(
                    request_json,
                    url,
                    "/init_weights_update_group",
                    {
                        "master_address": self.master_address,
                        "master_port": port,
                        "rank_offset": 1 + i * self.tp_size,
                        "world_size": world_size,
                        "group_name": self.group_name,
                        "backend": backend,
                    },
                    timeout_s=timeout_s,
                )
                for i, url in enumerate(urls)
            ]
            self._group = _new_process_group(
                backend, self.master_address, port, world_size, self.group_name, self.init_timeout_s
            )
        for url, fut in zip(urls, futures, strict=True):
            _check_success(url, "/init_weights_update_group", fut.result())
        self._urls = list(urls)

    def reset(self, live_urls: list[str]) -> None:
        """Drop the group after a server restart; the next update builds a new one with every server."""
        for url in live_urls:
            try:
                request_json(url, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout_s=60)
            except SGLangServerError as err:  # the survivor may not have joined the old group
                logger.warning("could not leave the old weight-update group on %s: %s", url, err)
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
        self._group, self._urls = None, None

    def close(self) -> None:
        if self._urls is not None:
            _each(
                self._urls,
                lambda u: request_json(
                    u, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout_s=60
                ),
            )
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
        self._group, self._urls = None, None

    def update(
        self, urls: list[str], buckets: Iterable[NamedTensorBucket], version: str, *, timeout_s: float
    ) -> SyncReport:
        start = time.perf_counter()
        if self._urls != list(urls):
            if self._urls is not None:
                self.close()
            self.connect(urls, timeout_s)
        tensors, count, nbytes = 0, 0, 0
        if self.split_experts:
            buckets = split_expert_buckets(buckets)
        with _Session(urls, timeout_s):
            for bucket in buckets:
                body = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name,
                    "flush_cache": False,
                    "weight_version": version,
                }
                answers: list = []
                errors: list[BaseException] = []

                def call(body=body, answers=answers, errors=errors) -> None:
                    try:
                        answers.extend(
                            _each(
                                urls,
                                lambda u: request_json(
                                    u, "/update_weights_from_distributed", body, timeout_s=timeout_s
                                ),
                            )
                        )
                    except BaseException as err:
                        errors.append(err)

                thread = threading.Thread(target=call, name="sglang-weight-update", daemon=True)
                thread.start()  # the servers block in broadcast(src=0) until rank 0 sends
                for _, t in bucket:
                    torch.distributed.broadcast(t.detach().to(self._device).contiguous(), src=0, group=self._group)
                thread.join(timeout_s)
                if thread.is_alive():
                    raise SGLangServerError(f"/update_weights_from_distributed did not finish within {timeout_s} s")
                if errors:
                    raise errors[0]
                for url, answer in zip(urls, answers, strict=True):
                    _check_success(url, "/update_weights_from_distributed", answer)
                tensors, count, nbytes = tensors + len(bucket), count + 1, nbytes + _nbytes(bucket)
        _finish(urls, version, timeout_s)
        return SyncReport("distributed", tensors, count, nbytes, time.perf_counter() - start)


def _new_process_group(backend: str, host: str, port: int, world_size: int, group_name: str, timeout_s: float):
    """Rank 0 of a process group outside the default one, compatible with SGLang's `init_custom_process_group`."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The store is made here, not by `rendezvous("tcp://...")`: under torchrun that would only connect to
    # torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) instead of hosting the servers' rendezvous.
    store = PrefixStore(group_name, TCPStore(host, port, world_size, is_master=True, timeout=timeout))
    group, _ = _new_process_group_helper(
        world_size, 0, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


# ---------------------------------------------------------------------------------------------- disk
@dataclass
class DiskWeightSync:
    """Safetensors shards in `directory` (shared with the servers), then `/update_weights_from_disk`."""

    directory: str = ""  # "" = a fresh temporary directory per update
    base_model_dir: str = ""  # non-weight files (config, tokenizer) to copy; "" = the served model_path
    keep: bool = False  # keep the written checkpoint after the update

    def __post_init__(self) -> None:
        # The served model's own directory, read once: after an update the server reports the (deleted)
        # temporary directory as its model_path.
        self._base = self.base_model_dir

    def reset(self, live_urls: list[str]) -> None:
        """Nothing to forget after a server restart (it serves its original model_path again)."""

    def update(
        self, urls: list[str], buckets: Iterable[NamedTensorBucket], version: str, *, timeout_s: float
    ) -> SyncReport:
        import tempfile

        from safetensors.torch import save_file

        start = time.perf_counter()
        out = Path(self.directory or tempfile.mkdtemp(prefix="megatron_rl_weights_"))
        out.mkdir(parents=True, exist_ok=True)
        if not self._base:
            self._base = request_json(urls[0], "/model_info", timeout_s=timeout_s)["model_path"]
        base = Path(self._base)
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
        shards: list[tuple[str, list[str]]] = []
        tensors, nbytes = 0, 0
        for i, bucket in enumerate(buckets):
            name = f"model-{i + 1:05d}.safetensors"
            save_file({n: t.detach().to("cpu").contiguous() for n, t in bucket}, str(out / name))
            shards.append((name, [n for n, _ in bucket]))
            tensors, nbytes = tensors + len(bucket), nbytes + _nbytes(bucket)
        index = {"metadata": {"total_size": nbytes}, "weight_map": {n: f for f, names in shards for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        body = {"model_path": str(out), "weight_version": version, "flush_cache": True}
        _each(
            urls,
            lambda u: _check_success(
                u, "/update_weights_from_disk", request_json(u, "/update_weights_from_disk", body, timeout_s=timeout_s)
            ),
        )
        if not self.keep and not self.directory:
            shutil.rmtree(out, ignore_errors=True)
        return SyncReport("disk", tensors, len(shards), nbytes, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- verification
def check_weights_arrived(
    score: Callable[[list[int]], list[float]], probe_ids: list[int], expected: list[float], atol: float
) -> float:
    """Max |served − expected| teacher-forced log-prob over `probe_ids[1:]`; raises if above `atol`.

    `score` is e.g. `SGLangEngine.score`; `expected` the trainer's own log-probs of the probe under the new weights.
    """
    served = score(probe_ids)
    if len(served) != len(expected):
        raise ValueError(f"{len(served)} served log-probs vs {len(expected)} expected")
    diff = max(abs(a - b) for a, b in zip(served, expected, strict=True))
    if diff > atol:
        raise RuntimeError(f"weights did not arrive: served log-probs differ from the trainer's by {diff:.4g} > {atol}")
    return diff
