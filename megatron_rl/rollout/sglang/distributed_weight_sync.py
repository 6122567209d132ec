"""The `distributed` weight-sync path, client side: a process group between the trainer (rank 0) and every
server TP rank (`/init_weights_update_group`, gloo on CPU, nccl on GPU); per bucket,
`/update_weights_from_distributed` (names/dtypes/shapes) runs in a thread while rank 0 broadcasts each tensor in
the same order, wrapped in begin/end_weight_update (`weight_sync` has the other paths and what they share).
The group's rendezvous store (`broadcast_store.GuardedStore`) listens on `master_address` only and serves only
clients that present the group's fresh random key prefix; forming the group and each collective end within
`group_timeout_s` with an error naming the address, the ranks and the likely cause.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch

from megatron_rl import accelerator
from megatron_rl.rollout.engine import NamedTensorBucket
from megatron_rl.rollout.sglang.broadcast_store import GuardedStore
from megatron_rl.rollout.sglang.sglang_server import SGLangServerError, request_json
from megatron_rl.rollout.sglang.weight_sync import (
    ServerSession,
    SyncReport,
    bucket_nbytes,
    check_success,
    finish_update,
    for_each_server,
    split_expert_buckets,
)

logger = logging.getLogger(__name__)

@dataclass
class DistributedWeightSync:
    """Broadcast from the trainer (rank 0 of a dedicated group) to every server TP rank."""

    backend: str = ""  # "" = nccl when CUDA is available, else gloo
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0 = a free port
    tp_size: int = 1  # TP ranks per server (engine rank = 1 + server index * tp_size + tp rank)
    group_name: str = "megatron_rl_weight_update"  # + a fresh random suffix per group (the store's key prefix)
    group_timeout_s: float = 120.0  # the group's formation, and each collective of a transfer
    split_experts: bool = True

    def __post_init__(self) -> None:
        self._group = None
        self._urls: list[str] | None = None
        self._device = torch.device("cpu")
        self._api_key: str | None = None
        self._group_id = self.group_name  # the current group's name: group_name + a random suffix
        self._store: GuardedStore | None = None
        self._where = ""  # "address:port (world size N)" of the current group, for error messages

    def connect(self, urls: list[str], timeout_s: float, api_key: str | None = None) -> None:
        """Create the group: every server joins via HTTP while this process joins as rank 0.

        The store listens on `master_address` only and serves only keys under the group's name, which gets a fresh
        random suffix that the servers learn only through the authenticated `/init_weights_update_group`. Raises
        `SGLangServerError` naming the address, the ranks and the likely cause when the group has not formed
        within `group_timeout_s`."""
        backend = self.backend or accelerator.default_collective_backend()
        self._device = accelerator.collective_device(backend)
        self._api_key = api_key
        self._group_id = f"{self.group_name}_{secrets.token_hex(16)}"
        listener = _listen(self.master_address, self.master_port)
        port = listener.getsockname()[1]
        world_size = 1 + len(urls) * self.tp_size
        self._where = f"{self.master_address}:{port} (world size {world_size})"
        self._store = GuardedStore(listener, self._group_id)
        pool = ThreadPoolExecutor(max(1, len(urls)))
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
                    "group_name": self._group_id,
                    "backend": backend,
                },
                timeout_s=timeout_s,
                api_key=api_key,
            )
            for i, url in enumerate(urls)
        ]
        try:
            self._group = _new_process_group(
                backend, self.master_address, port, world_size, self._group_id, self.group_timeout_s
            )
        except Exception as err:  # torch raises DistStoreError / DistNetworkError / RuntimeError
            answers = [_answer_of(url, f) for url, f in zip(urls, futures, strict=True)]
            pool.shutdown(wait=False, cancel_futures=True)  # a server that never answers must not hold us
            self._drop_group()
            raise SGLangServerError(
                f"the weight-broadcast group did not form within {self.group_timeout_s:g} s: rank 0 (this trainer) "
                f"waits at {self._where} for ranks 1..{world_size - 1}, the servers {self._ranks(urls)}; "
                f"their /init_weights_update_group: {'; '.join(answers)}. Likely causes: the servers cannot reach "
                f"{self.master_address}:{port} (rollout.sglang.trainer_address must be an address of this node "
                "that they can connect to; a firewall), a server that failed to join (see its answer and log), or "
                f"rollout.sglang.tp_size={self.tp_size} not the servers' TP size ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:300]})"
            ) from err
        pool.shutdown(wait=True)
        for url, fut in zip(urls, futures, strict=True):
            check_success(url, "/init_weights_update_group", fut.result())
        self._urls = list(urls)

    def _ranks(self, urls: list[str]) -> str:
        """Which group ranks each server's TP ranks are, e.g. "http://a:1 = rank 1, http://b:2 = ranks 3..4"."""
        parts = []
        for i, url in enumerate(urls):
            first, last = 1 + i * self.tp_size, (i + 1) * self.tp_size
            parts.append(f"{url} = rank {first}" if first == last else f"{url} = ranks {first}..{last}")
        return ", ".join(parts)

    def reset(self, live_urls: list[str], api_key: str | None = None) -> None:
        """Drop the group after a server restart; the next update builds a new one with every server."""
        for url in live_urls:
            try:
                body = {"group_name": self._group_id}
                request_json(url, "/destroy_weights_update_group", body, timeout_s=60, api_key=api_key or self._api_key)
            except SGLangServerError as err:  # the survivor may not have joined the old group
                logger.warning("could not leave the old weight-update group on %s: %s", url, err)
        self._drop_group()

    def _drop_group(self) -> None:
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
        if self._store is not None:
            self._store.close()
        self._group, self._urls, self._store = None, None, None

    def close(self) -> None:
        if self._urls is not None:
            body = {"group_name": self._group_id}
            for_each_server(
                self._urls,
                lambda u: request_json(u, "/destroy_weights_update_group", body, timeout_s=60, api_key=self._api_key),
            )
        self._drop_group()

    def update(
        self,
        urls: list[str],
        buckets: Iterable[NamedTensorBucket],
        version: str,
        *,
        timeout_s: float,
        api_key: str | None = None,
    ) -> SyncReport:
        start = time.perf_counter()
        if self._urls != list(urls):
            if self._urls is not None:
                self.close()
            self.connect(urls, timeout_s, api_key)
        tensors, count, nbytes = 0, 0, 0
        if self.split_experts:
            buckets = split_expert_buckets(buckets)
        with ServerSession(urls, timeout_s, api_key):
            for bucket in buckets:
                body = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self._group_id,
                    "flush_cache": False,
                    "weight_version": version,
                }
                answers: list = []
                errors: list[BaseException] = []

                def call(body=body, answers=answers, errors=errors) -> None:
                    try:
                        answers.extend(
                            for_each_server(
                                urls,
                                lambda u: request_json(
                                    u, "/update_weights_from_distributed", body, timeout_s=timeout_s, api_key=api_key
                                ),
                            )
                        )
                    except BaseException as err:
                        errors.append(err)

                thread = threading.Thread(target=call, name="sglang-weight-update", daemon=True)
                thread.start()  # the servers block in broadcast(src=0) until rank 0 sends
                self._broadcast_bucket(bucket, urls)
                thread.join(timeout_s)
                if thread.is_alive():
                    raise SGLangServerError(
                        f"/update_weights_from_distributed did not finish within {timeout_s:g} s after rank 0 "
                        f"broadcast its {len(bucket)} tensors to {self._ranks(urls)} at {self._where}"
                    )
                if errors:
                    raise errors[0]
                for url, answer in zip(urls, answers, strict=True):
                    check_success(url, "/update_weights_from_distributed", answer)
                tensors, count, nbytes = tensors + len(bucket), count + 1, nbytes + bucket_nbytes(bucket)
        finish_update(urls, version, timeout_s, api_key)
        return SyncReport("distributed", tensors, count, nbytes, time.perf_counter() - start)

    def _broadcast_bucket(self, bucket: NamedTensorBucket, urls: list[str]) -> None:
        """Rank 0's side of one bucket; a collective that fails or exceeds the group's timeout raises
        `SGLangServerError` and drops the group (the next update builds a new one)."""
        for name, t in bucket:
            try:
                torch.distributed.broadcast(t.detach().to(self._device).contiguous(), src=0, group=self._group)
            except Exception as err:  # gloo: RuntimeError on a timeout or a closed peer; nccl: DistBackendError
                where = self._where
                self._group = None  # unusable after a failed collective: not destroyed (that could block too)
                self._drop_group()
                raise SGLangServerError(
                    f"the weight broadcast of {name} from rank 0 at {where} to {self._ranks(urls)} failed or "
                    f"stalled (rollout.sglang.group_timeout_s={self.group_timeout_s:g}): likely causes: a server "
                    "died or restarted mid-transfer, the network between the trainer and the servers dropped, or a "
                    f"server expects other tensors ({type(err).__name__}: {str(err).splitlines()[0][:300]})"
                ) from err


def _answer_of(url: str, future: Future) -> str:
    """What a server's group-join request came to, for an error message (without waiting for it)."""
    if not future.done():
        return f"{url} has not answered"
    err = future.exception()
    if err is not None:
        return f"{url} failed: {err}"
    answer = future.result()
    if isinstance(answer, dict) and answer.get("success") is False:
        return f"{url} answered {answer.get('message')!r}"
    return f"{url} answered success"


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` only (`port` 0 = a free one), for the store; TCPStore alone listens on
    every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise SGLangServerError(
            f"cannot listen on {host}:{port} for the weight-sync group ({err}); rollout.sglang.trainer_address "
            "must be an address of trainer rank 0's node"
        ) from err
    return sock


def _new_process_group(backend: str, host: str, port: int, world_size: int, group_name: str, timeout_s: float):
    """Rank 0 of a process group outside the default one, compatible with SGLang's `init_custom_process_group`:
    a TCPStore client of the group's `GuardedStore` at `host:port`, under the key prefix `group_name`. Forming it
    and each collective on it time out after `timeout_s`."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # Our own store, not `rendezvous("tcp://...")`: under torchrun that would only connect to torchrun's agent
    # store (TORCHELASTIC_USE_AGENT_STORE) instead of hosting the servers' rendezvous.
    client = TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = PrefixStore(group_name, client)
    # torch's private helper types group_name as GroupName, a NewType over str that older torch does not define.
    group, _ = _new_process_group_helper(
        world_size,
        0,
        [],
        Backend(backend),
        store,
        group_name=group_name,  # type: ignore[arg-type]
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


