"""A stand-in for an SGLang server's side of `weight_sync=distributed` (SGLang 0.5.23's HTTP contract), for tests
where a real server cannot misbehave on demand.

    python weight_group_standin.py MODE

serves HTTP on a free port of 127.0.0.1, printed as the first line of its output. MODE:
- `never-join`: `/init_weights_update_group` is accepted and never answered, and the group is never joined (a
  server that cannot reach the trainer's address blocks so in `init_custom_process_group`);
- `join`: joins the group as SGLang does (`init_custom_process_group`: `rendezvous("tcp://addr:port")`, a
  `PrefixStore(group_name)`, `_new_process_group_helper`) and receives each `/update_weights_from_distributed`
  bucket by `broadcast(src=0)`, answering the received tensors' sums;
- `stall`: joins, but never receives a bucket, and never answers `/end_weight_update` (a server stuck
  mid-transfer).
Weight-session and version endpoints answer success.
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

MODE = sys.argv[1]
GROUPS: dict[str, object] = {}


def join(body: dict) -> dict:
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    rank, world = body["rank_offset"], body["world_size"]
    timeout = timedelta(seconds=60)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world = next(rendezvous(url, rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(body["group_name"], store)
    group, _ = _new_process_group_helper(
        world, rank, [], Backend(body["backend"]), store, group_name=body["group_name"], backend_options=None,
        timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    GROUPS[body["group_name"]] = group
    return {"success": True, "message": "joined"}


def receive(body: dict) -> dict:
    if MODE == "stall":
        threading.Event().wait()
    group = GROUPS[body["group_name"]]
    sums = []
    for dtype, shape in zip(body["dtypes"], body["shapes"], strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0, group=group)
        sums.append(float(t.double().sum()))
    return {"success": True, "message": "received", "sums": sums}


def destroy(body: dict) -> dict:
    group = GROUPS.pop(body["group_name"], None)
    if group is not None:
        dist.destroy_process_group(group)
    return {"success": True, "message": "destroyed"}


def init(body: dict) -> dict:
    if MODE == "never-join":
        threading.Event().wait()
    return join(body)


def end(body: dict) -> dict:
    if MODE == "stall":
        threading.Event().wait()
    return {"success": True}


ROUTES = {"/init_weights_update_group": init, "/update_weights_from_distributed": receive,
          "/destroy_weights_update_group": destroy, "/end_weight_update": end}  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        answer = ROUTES.get(self.path, lambda _: {"success": True})(body)
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()
