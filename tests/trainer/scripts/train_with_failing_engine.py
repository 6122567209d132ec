"""`megatron-rl train <args>` whose local rollout engine fails once: fault injection on the real `LocalEngine`.

The engine's first `generate` raises `RolloutEngineError` after putting back the weights it was launched with,
as a restarted server comes back without the weights synced into it. Every call the loop makes on the engine
(generate, recover, update_weights, with the weight version) is written as JSON lines to `$ENGINE_CALLS`.

    python train_with_failing_engine.py train <config.yaml> key=value ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from safetensors.torch import load_file

from megatron_rl.rollout.engine import RolloutEngineError
from megatron_rl.rollout.engines import local_engine

CALLS = Path(os.environ["ENGINE_CALLS"])


def record(**call) -> None:
    with CALLS.open("a") as f:
        f.write(json.dumps(call) + "\n")


class FailsOnceLocalEngine(local_engine.LocalEngine):
    failed = False

    def generate(self, prompts, params, **kwargs):
        record(call="generate", version=self.weight_version, prompts=prompts)
        if not self.failed:
            type(self).failed = True
            launched = [list(load_file(f).items()) for f in sorted(self.model_dir.glob("*.safetensors"))]
            super().update_weights(launched, version="launch")
            raise RolloutEngineError("injected: the rollout server died")
        return super().generate(prompts, params, **kwargs)

    def recover(self) -> list[str]:
        record(call="recover")
        return super().recover()

    def update_weights(self, buckets, version: str) -> None:
        record(call="update_weights", version=version)
        super().update_weights(buckets, version)


local_engine.LocalEngine = FailsOnceLocalEngine  # the loop imports the engine class from this module when it builds it

if __name__ == "__main__":
    from megatron_rl.cli import main

    sys.exit(main(sys.argv[1:]))
