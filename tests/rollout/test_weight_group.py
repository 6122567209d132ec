"""The `weight_sync=distributed` group against a stand-in server process (scripts/weight_group_standin.py, SGLang's
HTTP contract and its `init_custom_process_group`): a group nobody joins and a transfer that stalls end in the
clear error, not a hang; the group's store serves the joining server and refuses a second process that knows its
port but not the group's secret (it can neither list nor read nor set keys, nor join as a rank)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from megatron_rl.rollout.sglang import broadcast_store
from megatron_rl.rollout.sglang.distributed_weight_sync import DistributedWeightSync
from megatron_rl.rollout.sglang.sglang_server import SGLangServerError

STANDIN = Path(__file__).parent / "scripts" / "weight_group_standin.py"


@contextmanager
def standin(mode: str) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(STANDIN), mode], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())  # the server listens before it prints its port
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_a_group_nobody_joins_ends_in_an_error_naming_address_ranks_and_causes() -> None:
    sync = DistributedWeightSync(backend="gloo", group_timeout_s=2)
    with standin("never-join") as url:
        with pytest.raises(SGLangServerError) as err:
            sync.update([url], [[("w", torch.ones(4))]], "v1", timeout_s=600)  # the HTTP call never answers
    message = str(err.value)
    assert "the weight-broadcast group did not form within 2 s" in message
    assert "rank 0 (this trainer) waits at 127.0.0.1:" in message and "ranks 1..1" in message
    assert f"{url} = rank 1" in message and f"{url} has not answered" in message
    assert "rollout.sglang.trainer_address" in message and "rollout.sglang.tp_size=1" in message
    assert sync._store is None  # the store is closed, the next update builds a new group


@pytest.mark.slow
def test_a_transfer_that_stalls_mid_way_ends_in_the_process_group_timeout() -> None:
    sync = DistributedWeightSync(backend="gloo", group_timeout_s=3)
    big = torch.ones(32 << 20)  # 128 MiB: more than the sockets buffer, so rank 0's send blocks
    with standin("stall") as url:
        with pytest.raises(SGLangServerError) as err:
            sync.update([url], [[("model.embed_tokens.weight", big)]], "v1", timeout_s=600)
    message = str(err.value)
    assert "the weight broadcast of model.embed_tokens.weight from rank 0 at 127.0.0.1:" in message
    assert f"to {url} = rank 1 failed or stalled (rollout.sglang.group_timeout_s=3)" in message
    assert "a server died or restarted mid-transfer" in message  # and the stuck /end_weight_update did not hold it


ATTACKER = """
import socket, struct, sys
from datetime import timedelta
from torch.distributed import TCPStore
port = int(sys.argv[1])
out = []
raw = socket.create_connection(("127.0.0.1", port))
raw.sendall(struct.pack("<BI", 0, 0x3C85F7CE) + struct.pack("<B", 17))  # VALIDATE, then LIST_KEYS
out.append("list_keys answered %r" % raw.recv(1 << 16))
store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
for what, call in [("set", lambda: (store.set("mine", "1"), store.get("mine"))), ("num_keys", store.num_keys)]:
    try:
        out.append("%s answered %r" % (what, call()))
    except Exception as err:
        out.append("%s failed" % what)
from torch.distributed.distributed_c10d import PrefixStore, rendezvous
try:
    joined, _, _ = next(rendezvous("tcp://127.0.0.1:%d" % port, 1, 2, timeout=timedelta(seconds=5)))
    PrefixStore("megatron_rl_weight_update_guess", joined).set("rank", "1")
    PrefixStore("megatron_rl_weight_update_guess", joined).get("rank")
    out.append("join answered")
except Exception:
    out.append("join failed")
print("\\n".join(out))
"""


def test_the_store_serves_the_group_and_refuses_a_client_without_its_secret() -> None:
    sync = DistributedWeightSync(backend="gloo", group_timeout_s=60)
    weights = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.full((5,), 2.0, dtype=torch.bfloat16))]
    with standin("join") as url:
        sync.update([url], [weights], "v1", timeout_s=60)  # the stand-in joined through the store and received
        store = sync._store
        assert store is not None and not store.refused
        keys_before = set(store._data)
        attacker = subprocess.run([sys.executable, "-c", ATTACKER, str(store.port)], capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
        assert attacker.returncode == 0, attacker.stderr[-2000:]
        assert attacker.stdout.split("\n")[:4] == [
            "list_keys answered b''",  # the connection was closed: no key came back
            "set failed",
            "num_keys failed",
            "join failed",
        ], attacker.stdout
        assert set(store._data) == keys_before  # nothing the attacker sent was stored
        assert any("request type 17" in r for r in store.refused)
        assert any("outside the group's prefix ('/mine')" in r for r in store.refused)
        assert any("outside the group's prefix ('/megatron_rl_weight_update_guess/rank')" in r for r in store.refused)
        sync.update([url], [weights], "v2", timeout_s=60)  # the group still works after the refusals
        sync.close()


def test_the_guarded_store_refuses_a_client_without_the_handshake() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    store = broadcast_store.GuardedStore(listener, "secret")
    try:
        with socket.create_connection(("127.0.0.1", store.port)) as conn:
            conn.sendall(struct.pack("<B", broadcast_store.GET) + struct.pack("<Q", 3) + b"/x/")
            assert conn.recv(16) == b""  # closed without an answer
        assert store.refused == ["no TCPStore handshake"]
    finally:
        store.close()
