"""Park tensor storages in host memory and bring them back, bit for bit.

A trainer that shares its accelerator with a colocated rollout engine frees its parameters, gradient
buffers and optimizer state while the engine generates. Megatron keeps parameters and gradients as views
into contiguous buffers, and the distributed optimizer's shards are views of those, so `StorageOffload`
works on storages: each storage behind the given tensors is copied to the host once (pinned memory when
it lives on an accelerator) and then freed with `untyped_storage().resize_(0)`. Every tensor stays a valid
object (views, optimizer-state keys and `param.main_grad` keep their identity); only its bytes are gone
until `reload()` reallocates the storage and copies them back.

Pure torch, any device: on the CPU the "device" storage is itself host memory, and it is still copied to a
separate host tensor and freed, which is what the CPU tests check.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TransferStats:
    """One offload or reload: bytes moved, storages moved, wall time (including the device sync)."""

    bytes: int
    storages: int
    seconds: float

    @property
    def gib(self) -> float:
        return self.bytes / 2**30


class StorageOffload:
    """The distinct storages behind a collection of tensors, movable to the host and back.

    Storages are grouped when the object is built: tensors sharing a storage (views) are moved once, and
    storages that are already empty are skipped. Misuse raises RuntimeError: `offload()` while offloaded,
    `reload()` while resident.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        by_address: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            if not storage.resizable():
                raise ValueError(f"a {tuple(tensor.shape)} {tensor.dtype} tensor has a non-resizable storage")
            by_address.setdefault((storage.device, storage.data_ptr()), storage)
        self._storages = list(by_address.values())
        self._sizes = [s.nbytes() for s in self._storages]
        self._host: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of all distinct storages (what one offload or reload moves)."""
        return sum(self._sizes)

    @property
    def num_storages(self) -> int:
        return len(self._storages)

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    @torch.no_grad()
    def offload(self) -> TransferStats:
        """Copy every storage to the host, then free it on its device."""
        if self._host is not None:
            raise RuntimeError("StorageOffload.offload(): the storages are already offloaded")
        start = time.perf_counter()
        host = []
        for storage, size in zip(self._storages, self._sizes, strict=True):
            copy = torch.empty(size, dtype=torch.uint8, pin_memory=storage.device.type != "cpu")
            copy.copy_(_as_bytes(storage), non_blocking=True)
            host.append(copy)
        devices = self._devices()
        _synchronize(devices)  # the host copies are complete before the device memory goes
        for storage in self._storages:
            storage.resize_(0)
        _release_cached_memory(devices)
        self._host = host
        return TransferStats(self.nbytes, len(self._storages), time.perf_counter() - start)

    @torch.no_grad()
    def reload(self) -> TransferStats:
        """Reallocate every storage on its device and copy its bytes back; the host copies are dropped."""
        if self._host is None:
            raise RuntimeError("StorageOffload.reload(): the storages are not offloaded")
        start = time.perf_counter()
        for storage, size, copy in zip(self._storages, self._sizes, self._host, strict=True):
            storage.resize_(size)
            _as_bytes(storage).copy_(copy, non_blocking=True)
        _synchronize(self._devices())  # the pinned host copies may be reused once this returns
        self._host = None
        return TransferStats(self.nbytes, len(self._storages), time.perf_counter() - start)

    def _devices(self) -> set[torch.device]:
        return {s.device for s in self._storages}


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type != "cpu":
            torch.get_device_module(device.type).synchronize(device)


def _release_cached_memory(devices: set[torch.device]) -> None:
    """Hand freed blocks back to the driver, so that another process (the rollout engine) can use them."""
    for device_type in {d.type for d in devices if d.type != "cpu"}:
        torch.get_device_module(device_type).empty_cache()
