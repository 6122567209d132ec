"""`megatron-rl train <args>` whose local engine ends a sync on other weights than it was sent: fault injection on
the real `LocalEngine`, as an engine kernel that re-lays out expert weights after loading would.

When the engine is first asked to score a weight-sync probe at version `$PERTURB_AT`, it records the probe
prompts' routes (a greedy one-token generate), picks the layer-0 expert those prompt tokens are routed to most,
scales that expert's weights by 1.5 and writes {"version", "layer", "expert", "routed_tokens", "probe_tokens"} to
`$PERTURBED`, then scores the probe.

    python train_with_perturbed_expert.py train <config.yaml> key=value ...
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engines import local_engine


class PerturbedExpertEngine(local_engine.LocalEngine):
    def score_prompts(self, prompts):
        if self.weight_version == os.environ["PERTURB_AT"] and not Path(os.environ["PERTURBED"]).exists():
            self._perturb_most_routed_expert(prompts)
        return super().score_prompts(prompts)

    def _perturb_most_routed_expert(self, prompts) -> None:
        samples = self.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0), return_routed_experts=True)
        # routed_experts: [prompt + response - 1 fed positions, moe_layers, top_k]; the prompt's are its first rows.
        layer0 = Counter(int(e) for s in samples for row in s.routed_experts[: len(s.prompt_ids)] for e in row[0])
        expert, routed = layer0.most_common(1)[0]
        experts = self.model.model.layers[0].mlp.experts
        with torch.no_grad():
            experts.gate_up_proj[expert].mul_(1.5)
            experts.down_proj[expert].mul_(1.5)
        record = {
            "version": self.weight_version,
            "layer": 0,
            "expert": expert,
            "routed_tokens": routed,
            "probe_tokens": sum(len(p) for p in prompts),
        }
        Path(os.environ["PERTURBED"]).write_text(json.dumps(record))


local_engine.LocalEngine = PerturbedExpertEngine  # the loop imports the engine class from this module when it builds it

if __name__ == "__main__":
    from megatron_rl.cli import main

    sys.exit(main(sys.argv[1:]))
