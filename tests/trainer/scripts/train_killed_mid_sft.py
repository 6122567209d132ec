"""`megatron-rl <args>` killed (SIGKILL, no clean-up) just before supervised warm-up step `$KILL_AT_SFT_STEP`.

The real CLI and trainer run unchanged; the only change is that the actor's `warmup_step` kills the process group
(the trainer and its checkpoint writer) when it is asked for that step, as a crash or a preempted node does. Start
it as a session of its own (`start_new_session=True`): it refuses to kill a group it does not lead.

    KILL_AT_SFT_STEP=5 python train_killed_mid_sft.py train <config.yaml> key=value ...
"""

from __future__ import annotations

import os
import signal
import sys

from megatron_rl.megatron_backend.actor import MegatronActor

KILL_AT = int(os.environ["KILL_AT_SFT_STEP"])
warmup_step = MegatronActor.warmup_step
calls = 0


def killing_warmup_step(self, *args, **kwargs):
    global calls
    calls += 1
    if calls == KILL_AT:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return warmup_step(self, *args, **kwargs)


if __name__ == "__main__":  # (not in the helper processes that re-import this file)
    if os.getpgrp() != os.getpid():
        sys.exit("train_killed_mid_sft.py must lead its process group (start it with start_new_session=True)")
    MegatronActor.warmup_step = killing_warmup_step  # type: ignore[method-assign]
    from megatron_rl.cli import main

    sys.exit(main(sys.argv[1:]))
