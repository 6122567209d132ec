"""The stand-in engine of ranks other than 0 (`rollout_phase.NoEngine`): it takes part in the weight export and
refuses everything only rank 0 does."""

from __future__ import annotations

import pytest

from megatron_rl.trainer.rollout_phase import NoEngine


def test_no_engine_drains_its_share_of_the_weight_export_and_refuses_to_generate() -> None:
    exported: list[int] = []

    def buckets():  # a rank's export: each bucket is a collective gather every rank must join
        for i in range(3):
            exported.append(i)
            yield [(f"w{i}", None)]

    engine = NoEngine()
    engine.update_weights(buckets(), "step-4")
    assert exported == [0, 1, 2]
    engine.release_memory(["weights"])
    engine.resume_memory(None)
    assert engine.recover() == []
    refused = (lambda: engine.generate([[1]], None), lambda: engine.score_prompts([[1]]), lambda: engine.weight_version)
    for call in refused:
        with pytest.raises(RuntimeError, match="only rank 0 holds the rollout engine"):
            call()
