"""torchrun as the SLURM templates run it (`python -m megatron_rl.launch.torchrun ARGS`): torch.distributed.run,
except that a SIGTERM/SIGINT that stops the job ends it with one line instead of torchrun's SignalException
traceback. The workers stop at their step boundary and save (their last line says how to resume); torchrun
itself exits 128 + signal here (plain torchrun exits 1 with a traceback).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as err:
        print(f"torchrun: stopped by {err.sigval.name}; the workers stopped at a step boundary or were ended after "
              "its --shutdown-timeout (see their last lines)", file=sys.stderr, flush=True)  # fmt: skip
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
