"""Pushing trainer weights into SGLang servers: the three paths, client side.

Input everywhere: an iterable of buckets `list[(hf_name, full_tensor)]`, e.g.
`MegatronActor.export_hf(bucket_bytes=...)`.

- `tensor`: `/begin_weight_update` → one `/update_weights_from_tensor` per bucket, whose payload is a base64 pickle
  of the bucket's CPU tensors *by value* (works across unrelated processes and machines; one copy per server TP
  rank) → `/end_weight_update`. Simple, but every byte goes through JSON/HTTP.
- `distributed` (`distributed_weight_sync`): a process group between the trainer (rank 0) and every server TP
  rank (`/init_weights_update_group`, gloo on CPU, nccl on GPU); per bucket, `/update_weights_from_distributed`
  (names/dtypes/shapes) runs in a thread while rank 0 broadcasts each tensor in the same order. Also wrapped in
  begin/end_weight_update.
- `disk`: HF safetensors shards (+ index and the non-weight files of the served checkpoint) written to a directory
  the servers can read, then `/update_weights_from_disk`.
- `AdapterSync` (`rollout.lora_sync=adapter`): not weights but the policy's LoRA adapter, served by SGLang on its
  base (`/load_lora_adapter_from_tensors`).

Every path ends with the new `weight_version` on the servers and a flushed prefix cache; `update()` returns a
`SyncReport` (bytes, seconds); `sync_probe` checks that the engine computes with the weights sent.
Every HTTP call carries the servers' API key (`api_key=`). The broadcast group's rendezvous store
(`broadcast_store.GuardedStore`) listens on `master_address` only and serves only clients that present the group's
fresh random key prefix, which only the servers learn, over the authenticated API (docs/security.md says what that
does and does not protect). The group's formation and each of its collectives end within `group_timeout_s` with
an error naming the address, the ranks and the likely cause.
"""

from __future__ import annotations

import base64
import logging
import pickle
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from megatron_rl.formats.safetensors_files import copy_files, is_weights_file, write_safetensors_dir
from megatron_rl.rollout.engine import NamedTensorBucket
from megatron_rl.rollout.sglang.sglang_server import SGLangServerError, request_json

logger = logging.getLogger(__name__)


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
        self,
        urls: list[str],
        buckets: Iterable[NamedTensorBucket],
        version: str,
        *,
        timeout_s: float,
        api_key: str | None = None,
    ) -> SyncReport: ...

    def reset(self, live_urls: list[str], api_key: str | None = None) -> None:
        """Forget per-server state after a server restart (`live_urls`: the servers that kept running)."""
        ...


def split_expert_buckets(buckets: Iterable[NamedTensorBucket]) -> Iterable[NamedTensorBucket]:
    """Put each bucket's routed-expert tensors (`.mlp.experts.`) into a bucket of their own (order kept)."""
    for bucket in buckets:
        dense = [(n, t) for n, t in bucket if ".experts." not in n]
        experts = [(n, t) for n, t in bucket if ".experts." in n]
        yield from (b for b in (dense, experts) if b)


def bucket_nbytes(bucket: NamedTensorBucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def for_each_server(urls: list[str], fn: Callable[[str], object]) -> list:
    """`fn(url)` for every server concurrently; the first error is raised after all have finished."""
    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        futures = [pool.submit(fn, u) for u in urls]
    return [f.result() for f in futures]


def finish_update(urls: list[str], version: str, timeout_s: float, api_key: str | None) -> None:
    for_each_server(urls, lambda u: request_json(u, "/flush_cache", {}, timeout_s=timeout_s, api_key=api_key))
    body = {"new_version": version, "abort_all_requests": False}
    update = "/update_weight_version"
    for_each_server(urls, lambda u: request_json(u, update, body, timeout_s=timeout_s, api_key=api_key))


def check_success(url: str, path: str, answer: object) -> None:
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SGLangServerError(f"SGLang {url}{path} failed: {answer.get('message')}")


AFTER_FAILURE_TIMEOUT_S = 30.0  # the longest a server may take to end a weight update that already failed


class ServerSession:
    """`/begin_weight_update` … `/end_weight_update` on every server (mandatory since SGLang 0.5.22)."""

    def __init__(self, urls: list[str], timeout_s: float, api_key: str | None):
        self.urls, self.timeout_s, self.api_key = urls, timeout_s, api_key

    def _call(self, path: str, body: dict, timeout_s: float) -> None:
        for_each_server(self.urls, lambda u: request_json(u, path, body, timeout_s=timeout_s, api_key=self.api_key))

    def __enter__(self) -> ServerSession:
        self._call("/begin_weight_update", {"selector": "all"}, self.timeout_s)
        return self

    def __exit__(self, *exc) -> None:
        # After a failure (a stalled broadcast) a server may be stuck: its session end must not hold the error.
        timeout_s = self.timeout_s if exc[0] is None else min(self.timeout_s, AFTER_FAILURE_TIMEOUT_S)
        try:
            self._call("/end_weight_update", {}, timeout_s)
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

    def reset(self, live_urls: list[str], api_key: str | None = None) -> None:
        """Stateless between updates: nothing to forget after a server restart."""

    def update(
        self,
        urls: list[str],
        buckets: Iterable[NamedTensorBucket],
        version: str,
        *,
        timeout_s: float,
        api_key: str | None = None,
    ) -> SyncReport:
        start, tensors, count, nbytes = time.perf_counter(), 0, 0, 0
        if self.split_experts:
            buckets = split_expert_buckets(buckets)
        with ServerSession(urls, timeout_s, api_key):
            for bucket in buckets:
                payload = serialize_bucket(bucket)
                body = {
                    "serialized_named_tensors": [payload] * self.tp_size,
                    "flush_cache": False,
                    "weight_version": version,
                }

                def send(url: str, body=body) -> None:
                    check_success(
                        url,
                        "/update_weights_from_tensor",
                        request_json(url, "/update_weights_from_tensor", body, timeout_s=timeout_s, api_key=api_key),
                    )

                for_each_server(urls, send)
                tensors, count, nbytes = tensors + len(bucket), count + 1, nbytes + bucket_nbytes(bucket)
        finish_update(urls, version, timeout_s, api_key)
        return SyncReport("tensor", tensors, count, nbytes, time.perf_counter() - start)


def serialize_bucket(bucket: NamedTensorBucket) -> str:
    """Base64 pickle of `[(name, contiguous cpu tensor)]`, tensors by value (SGLang's SafeUnpickler accepts it)."""
    cpu = [(name, t.detach().to("cpu").contiguous()) for name, t in bucket]
    return base64.b64encode(pickle.dumps(cpu, protocol=pickle.HIGHEST_PROTOCOL)).decode()


# ---------------------------------------------------------------------------------------------- disk
@dataclass
class DiskWeightSync:
    """Safetensors shards in `directory` (shared with the servers), then `/update_weights_from_disk`."""

    directory: str = ""  # replaced as a whole by each update; "" = a fresh temporary directory per update
    base_model_dir: str = ""  # non-weight files (config, tokenizer) to copy; "" = the served model_path
    keep: bool = False  # keep the written checkpoint after the update

    def __post_init__(self) -> None:
        # The served model's own directory, read once: after an update the server reports the (deleted)
        # temporary directory as its model_path.
        self._base = self.base_model_dir

    def reset(self, live_urls: list[str], api_key: str | None = None) -> None:
        """Nothing to forget after a server restart (it serves its original model_path again)."""

    def update(
        self,
        urls: list[str],
        buckets: Iterable[NamedTensorBucket],
        version: str,
        *,
        timeout_s: float,
        api_key: str | None = None,
    ) -> SyncReport:
        import tempfile

        start = time.perf_counter()
        out = Path(self.directory or tempfile.mkdtemp(prefix="megatron_rl_weights_"))
        if not self._base:
            self._base = request_json(urls[0], "/model_info", timeout_s=timeout_s, api_key=api_key)["model_path"]
        base = Path(self._base)

        def copy_base_files(staging: Path) -> None:
            copy_files(base, staging, [f.name for f in base.iterdir() if f.is_file() and not is_weights_file(f.name)])

        written = write_safetensors_dir(out, buckets, extra_files=copy_base_files)
        body = {"model_path": str(out), "weight_version": version, "flush_cache": True}
        for_each_server(
            urls,
            lambda u: check_success(
                u,
                "/update_weights_from_disk",
                request_json(u, "/update_weights_from_disk", body, timeout_s=timeout_s, api_key=api_key),
            ),
        )
        if not self.keep and not self.directory:
            shutil.rmtree(out, ignore_errors=True)
        return SyncReport("disk", written.tensors, written.shards, written.bytes, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- LoRA adapter
ADAPTER_NAME = "policy"  # the one adapter a run serves; each /generate names it (`lora_path`)
_UNLOAD, _LOAD = "/unload_lora_adapter", "/load_lora_adapter_from_tensors"


@dataclass
class AdapterSync:
    """The policy's LoRA adapter to every server (`rollout.lora_sync=adapter`), by value: SGLang 0.5.23's
    `LoadLoRAAdapterFromTensorsReqInput` (`lora_name`, `config_dict` = the adapter_config.json, one base64 pickle of
    `{name: tensor}` per server TP rank in `serialized_named_tensors`). A name loads once, so the last adapter is
    unloaded first (an unload a server that does not hold it refuses is ignored unless it was known to hold it)."""

    tp_size: int = 1
    loaded: set[str] = field(default_factory=set)  # servers known to hold ADAPTER_NAME

    def reset(self, live_urls: list[str]) -> None:
        """After a restart: the restarted servers hold no adapter."""
        self.loaded &= set(live_urls)

    def update(
        self, urls: list[str], tensors: dict[str, torch.Tensor], config: dict[str, Any], version: str, *,
        timeout_s: float, api_key: str | None = None,
    ) -> SyncReport:  # fmt: skip
        start = time.perf_counter()
        named = [(name, t.detach().to("cpu").contiguous()) for name, t in tensors.items()]
        payload = base64.b64encode(pickle.dumps(dict(named), protocol=pickle.HIGHEST_PROTOCOL)).decode()
        body = {"lora_name": ADAPTER_NAME, "config_dict": config, "serialized_named_tensors": [payload] * self.tp_size,
                "pinned": False}  # fmt: skip

        def load(url: str) -> None:
            try:
                answer = request_json(url, _UNLOAD, {"lora_name": ADAPTER_NAME}, timeout_s=timeout_s, api_key=api_key)
                check_success(url, _UNLOAD, answer)
            except SGLangServerError:
                if url in self.loaded:
                    raise
            self.loaded.discard(url)
            check_success(url, _LOAD, request_json(url, _LOAD, body, timeout_s=timeout_s, api_key=api_key))
            self.loaded.add(url)

        for_each_server(urls, load)
        finish_update(urls, version, timeout_s, api_key)
        return SyncReport("adapter", len(named), 1, bucket_nbytes(named), time.perf_counter() - start)
