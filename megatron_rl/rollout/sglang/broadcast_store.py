"""The weight-broadcast group's rendezvous store: torch's TCPStore wire protocol, served only to clients that
present the group's secret.

SGLang servers join the group with a plain `TCPStore` client (`init_custom_process_group(init_method=tcp://...)`,
keys under `PrefixStore(group_name)`) and send nothing else, so the only secret a client can present in-protocol
is the key prefix: the group name, made fresh and random (128 bits) per group and given to the servers only through
the authenticated `/init_weights_update_group`. `GuardedStore` speaks TCPStore's protocol (torch 2.13,
`TCPStoreBackend.hpp` / `TCPStoreLibUvBackend.cpp`) and closes a connection at its first request that
- comes before the VALIDATE handshake (the magic number),
- lists or counts keys (LIST_KEYS, GETNUMKEYS) or uses queues or barriers,
- names any key outside `/<prefix>/` (TCPStore's "/" and PrefixStore's "<prefix>/"), except an ADD of TCPStore's
  worker counter `init/`, which every client sends on connecting and which reveals nothing.
So a process that knows the port but not the prefix can neither learn nor read nor set a key of the group; it
cannot take a rank. The data connections (gloo pairs, NCCL) the ranks open after the rendezvous are not covered.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

VALIDATION_MAGIC = 0x3C85F7CE
# torch's c10d::detail::QueryType
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND = range(10)
MULTI_GET, MULTI_SET, CANCEL_WAIT, PING = range(10, 14)
READY, NOT_READY = 0, 1  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType
WORKER_COUNTER = "init/"  # TCPStore's own key: each client adds 1 when it connects
MAX_PAYLOAD = 1 << 30
_CANCEL_POLL_S = 0.2  # how often a WAIT re-checks its socket for the client's CANCEL_WAIT


class Refused(Exception):
    """A client broke the protocol or asked for something outside the group's prefix."""


class GuardedStore:
    """A TCPStore server on `listener` that serves only keys under `prefix` (see the module docstring)."""

    def __init__(self, listener: socket.socket, prefix: str):
        self.listener = listener
        self.allowed = f"/{prefix}/"
        self.port: int = listener.getsockname()[1]
        self.refused: list[str] = []  # why each refused client was dropped (for tests and logs)
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._clients: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="weight-broadcast-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, drop every client."""
        self._closed = True
        with self._changed:
            self._changed.notify_all()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for conn in list(self._clients):
            _close(conn)

    # ------------------------------------------------------------------ serving
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return
            self._clients.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="weight-broadcast-store-client",
                             daemon=True).start()  # fmt: skip

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        wire = _Wire(conn)
        try:
            if wire.u8() != VALIDATE or wire.u32() != VALIDATION_MAGIC:
                raise Refused("no TCPStore handshake")
            while not self._closed:
                self._answer(wire, wire.u8())
        except Refused as err:
            self.refused.append(str(err))
            logger.warning("weight-broadcast store: refused the client at %s: %s", peer[0], err)
        except (ConnectionError, OSError, EOFError):
            pass  # the client left
        finally:
            self._clients.discard(conn)
            _close(conn)

    def _key(self, wire: _Wire, *, add: bool = False) -> str:
        key = wire.string().decode("utf-8", errors="replace")
        if key.startswith(self.allowed) or (add and key == WORKER_COUNTER):
            return key
        raise Refused(f"a key outside the group's prefix ({key[:40]!r})")

    def _answer(self, wire: _Wire, command: int) -> None:
        handlers: dict[int, Callable[[_Wire], None]] = {
            SET: self._set, COMPARE_SET: self._compare_set, GET: self._get, ADD: self._add, CHECK: self._check,
            WAIT: self._wait, DELETE_KEY: self._delete, APPEND: self._append, MULTI_GET: self._multi_get,
            MULTI_SET: self._multi_set, CANCEL_WAIT: lambda w: w.send(struct.pack("<B", WAIT_CANCELED)),
            PING: lambda w: w.send(struct.pack("<I", w.u32())),
        }  # fmt: skip
        handler = handlers.get(command)
        if handler is None:
            raise Refused(f"request type {command} (listing or counting keys, queues and barriers are refused)")
        handler(wire)

    def _store(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def _set(self, w: _Wire) -> None:
        key = self._key(w)
        self._store(key, w.string())

    def _compare_set(self, w: _Wire) -> None:
        key, expected, desired = self._key(w), w.string(), w.string()
        with self._changed:
            current = self._data.get(key)
            if current is None:
                result = desired if not expected else expected
                if not expected:
                    self._data[key] = desired
            elif current == expected:
                self._data[key] = result = desired
            else:
                result = current
            self._changed.notify_all()
        w.send(_vector(result))

    def _get(self, w: _Wire) -> None:
        key = self._key(w)
        w.send(_vector(self._data.get(key, b"")))

    def _add(self, w: _Wire) -> None:
        key, delta = self._key(w, add=True), w.i64()
        with self._changed:
            value = int(self._data.get(key, b"0")) + delta
            self._data[key] = str(value).encode()
            self._changed.notify_all()
        w.send(struct.pack("<q", value))

    def _keys(self, w: _Wire) -> list[str]:
        count = w.u64()
        if count > 1 << 16:
            raise Refused(f"{count} keys in one request")
        return [self._key(w) for _ in range(count)]

    def _check(self, w: _Wire) -> None:
        keys = self._keys(w)
        w.send(struct.pack("<B", READY if all(k in self._data for k in keys) else NOT_READY))

    def _wait(self, w: _Wire) -> None:
        """Answer STOP_WAITING once every key exists, or WAIT_CANCELED when the client gives up first."""
        keys = self._keys(w)
        with self._changed:
            while not all(k in self._data for k in keys):
                if self._closed:
                    return
                self._changed.wait(_CANCEL_POLL_S)
                if select.select([w.conn], [], [], 0)[0]:  # the client's next request during a wait
                    if w.u8() != CANCEL_WAIT:
                        raise Refused("a request other than CANCEL_WAIT during a WAIT")
                    w.send(struct.pack("<B", WAIT_CANCELED))
                    return
        w.send(struct.pack("<B", STOP_WAITING))

    def _delete(self, w: _Wire) -> None:
        key = self._key(w)
        with self._changed:
            deleted = int(self._data.pop(key, None) is not None)
        w.send(struct.pack("<q", deleted))

    def _append(self, w: _Wire) -> None:
        key, value = self._key(w), w.string()
        with self._changed:
            self._data[key] = self._data.get(key, b"") + value
            self._changed.notify_all()

    def _multi_get(self, w: _Wire) -> None:
        keys = self._keys(w)
        w.send(b"".join(_vector(self._data.get(k, b"")) for k in keys))

    def _multi_set(self, w: _Wire) -> None:
        count = w.u64()
        if count > 1 << 16:
            raise Refused(f"{count} keys in one request")
        for _ in range(count):
            key = self._key(w)
            self._store(key, w.string())


class _Wire:
    """TCPStore's framing: little-endian integers, strings and payloads as a uint64 length and the bytes."""

    def __init__(self, conn: socket.socket):
        self.conn = conn

    def read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.conn.recv(min(left, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def u8(self) -> int:
        return self.read(1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def i64(self) -> int:
        return struct.unpack("<q", self.read(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        if n > MAX_PAYLOAD:
            raise Refused(f"a payload of {n} bytes")
        return self.read(n)

    def send(self, data: bytes) -> None:
        self.conn.sendall(data)


def _vector(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()
