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
    """A worker: answer calls until the parent closes the pipe."""
    receive, send = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    send.send_bytes(b"ready")
    while True:
        try:
            payload = receive.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            outcome: Outcome = run_task(pickle.loads(payload))
        except BaseException as err:  # noqa: BLE001 - e.g. the function's module does not import here
            outcome = Failure(f"cannot load the reward in its worker: {type(err).__name__}: {err}")
        try:
            send.send(outcome)
        except Exception as err:  # noqa: BLE001
            send.send(Failure(f"cannot send the reward back: {type(err).__name__}: {err}"))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = json.loads(sys.argv[3])
    _serve(int(sys.argv[1]), int(sys.argv[2]))
