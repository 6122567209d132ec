"""A reward worker process (started by `worker_pool.WorkerPool`): `python -m megatron_rl.rollout.rewards.worker
READ_FD WRITE_FD SYS_PATH_JSON` answers pickled reward calls until its pipe closes."""

from __future__ import annotations

import json
import pickle
import signal
import sys
from multiprocessing.connection import Connection

from megatron_rl.rollout.rewards.user_functions import Failure, Outcome, run_task


def _serve(read_fd: int, write_fd: int) -> None:
    """A worker: import functions and answer calls until the parent closes the pipe. A message is b"L" + a pickled
    function (import it; answer None, or why it failed) or b"C" + a pickled `RewardTask` (answer its `Outcome`)."""
    receive, send = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    send.send_bytes(b"ready")
    while True:
        try:
            message = receive.recv_bytes()
        except (EOFError, OSError):
            return
        kind, payload = message[:1], message[1:]
        if kind == b"L":
            try:
                pickle.loads(payload)
                send.send(None)
            except BaseException as err:  # noqa: BLE001 - e.g. its module does not import here
                send.send(f"{type(err).__name__}: {err}")
            continue
        try:
            outcome: Outcome = run_task(pickle.loads(payload))
        except BaseException as err:  # noqa: BLE001
            outcome = Failure(f"cannot load the reward call in its worker: {type(err).__name__}: {err}")
        try:
            send.send(outcome)
        except Exception as err:  # noqa: BLE001
            send.send(Failure(f"cannot send the reward back: {type(err).__name__}: {err}"))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = json.loads(sys.argv[3])
    _serve(int(sys.argv[1]), int(sys.argv[2]))
