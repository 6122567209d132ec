"""`megatron-rl train <args>` against SGLang servers, with two test hooks on the real `SGLangEngine`:

- `$PERTURB_AT=<version>`: when the engine is first asked to score the weight-sync probe at that version, it reads
  the probe prompts' routes from the server (a greedy one-token generate with `return_routed_experts`; the server
  runs with `--enable-return-routed-experts`), picks the layer-0 expert those prompt tokens are routed to most,
  sends that expert's weights scaled by 1.5 to the server (`/update_weights_from_tensor`, the version unchanged),
  and writes {"version", "expert", "routed_tokens"} to `$PERTURBED`: the server then computes with other weights
  than the trainer sent, as after a kernel that re-lays out expert weights.
- `$PROBE_MEASURE=1`: the probe's tolerances are infinite, so a run logs the healthy |dlogp| of every verified
  sync (`sync/probe_logp_diff_max`, `sync/probe_logp_diff_mean`) without stopping: how docs/reliability.md's
  tolerances were measured.

    python train_sglang_probe.py train <config.yaml> key=value ...
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout import sync_probe
from megatron_rl.rollout.sglang import sglang_engine
from megatron_rl.rollout.sglang.weight_sync import TensorWeightSync

LAYER0_EXPERT = "model.layers.0.mlp.experts.{}."


class PerturbingEngine(sglang_engine.SGLangEngine):
    def update_weights(self, buckets, version: str) -> None:
        if version != os.environ.get("PERTURB_AT"):
            return super().update_weights(buckets, version)
        self._layer0 = {}

        def keep_layer0(stream):
            for bucket in stream:
                for name, t in bucket:
                    if name.startswith("model.layers.0.mlp.experts."):
                        self._layer0[name] = t.detach().clone()
                yield bucket

        return super().update_weights(keep_layer0(buckets), version)

    def score_prompts(self, prompts):
        marker = Path(os.environ.get("PERTURBED", "/nonexistent/x"))
        if self.weight_version == os.environ.get("PERTURB_AT") and not marker.exists():
            samples = self.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0),
                                    return_routed_experts=True)  # fmt: skip
            routed = Counter(int(e) for s in samples for row in s.routed_experts[: len(s.prompt_ids)] for e in row[0])
            expert, count = routed.most_common(1)[0]
            prefix = LAYER0_EXPERT.format(expert)
            scaled = [(name, t * 1.5) for name, t in self._layer0.items() if name.startswith(prefix)]
            TensorWeightSync().update(self.urls, [scaled], self.weight_version, timeout_s=120, api_key=self._key)
            marker.write_text(json.dumps({"version": self.weight_version, "expert": expert, "routed_tokens": count}))
        return super().score_prompts(prompts)


sglang_engine.SGLangEngine = PerturbingEngine  # the factory imports the class from this module when it builds it
if os.environ.get("PROBE_MEASURE"):
    loose = sync_probe.ProbeTolerance(math.inf, math.inf)
    sync_probe.TOLERANCES.update({dtype: loose for dtype in sync_probe.TOLERANCES})

if __name__ == "__main__":
    from megatron_rl.cli import main

    sys.exit(main(sys.argv[1:]))
