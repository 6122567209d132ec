"""`megatron-rl <args>` that gets `$STOP_SIGNAL` (KILL or INT) at its `$STOP_AT_CALL`-th supervised warm-up step.

The real CLI and trainer run unchanged; the only change is that the actor's `warmup_step`, on that call, first
sends the signal: SIGKILL to the process group (the trainer and its checkpoint writer, no clean-up), as a crash or
a preempted node does, or SIGINT to the trainer, as a Ctrl-C does (the warm-up stops after that step). Start it as
a session of its own (`start_new_session=True`): it refuses to kill a group it does not lead.

    STOP_AT_CALL=5 STOP_SIGNAL=KILL python train_killed_mid_sft.py train <config.yaml> key=value ...
"""

from __future__ import annotations

import os
import signal
import sys

from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor

STOP_AT = int(os.environ["STOP_AT_CALL"])
SIGNAL = signal.Signals[f"SIG{os.environ['STOP_SIGNAL']}"]
warmup_step = MegatronActor.warmup_step
calls = 0


def signalled_warmup_step(self, *args, **kwargs):
    global calls
    calls += 1
    if calls == STOP_AT:
        if SIGNAL == signal.SIGKILL:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), SIGNAL)
    return warmup_step(self, *args, **kwargs)


if __name__ == "__main__":  # (not in the helper processes that re-import this file)
    if os.getpgrp() != os.getpid():
        sys.exit("train_killed_mid_sft.py must lead its process group (start it with start_new_session=True)")
    MegatronActor.warmup_step = signalled_warmup_step  # type: ignore[method-assign]
    from megatron_rl.cli import main

    sys.exit(main(sys.argv[1:]))
