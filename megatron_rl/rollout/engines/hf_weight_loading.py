"""Load checkpoint-named HF tensors (what `MegatronActor.export_hf` yields) into an in-memory transformers model.

transformers 5 fuses MoE experts in memory (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj
[E, H, I]`) while checkpoints and our exporter name them per expert (`mlp.experts.{e}.gate_proj.weight`, or
Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3.weight`). `HFWeightTarget` resolves either naming to the
parameter slice it fills; every name and shape is checked before anything is copied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

# Per-expert checkpoint name -> fused parameter: (fused attribute, which half of gate_up_proj or None).
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>(gate|up|down)_proj|w1|w2|w3)\.weight$")
_FUSED_SLOT = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}


class WeightUpdateError(ValueError):
    """A tensor sent to the engine does not name or fit a parameter of its model."""


@dataclass(frozen=True)
class HFWeightTarget:
    """Where one checkpoint-named tensor goes: a parameter (by in-memory name) and the view of it to fill."""

    param_name: str
    expert: int | None = None  # index into a fused [E, ...] expert parameter
    half: int | None = None  # 0 = gate rows, 1 = up rows of gate_up_proj

    def view(self, param: torch.Tensor) -> torch.Tensor:
        out = param
        if self.expert is not None:
            out = out[self.expert]
        if self.half is not None:
            rows = out.shape[0] // 2
            out = out[self.half * rows : (self.half + 1) * rows]
        return out


class HFWeightLoader:
    """Resolves and copies HF-named tensors into `model`'s parameters and the buffers its checkpoints hold (a
    router's `e_score_correction_bias`); strict: an unknown name or shape raises."""

    def __init__(self, model: nn.Module):
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        saved = model.state_dict(keep_vars=True)  # persistent buffers only (not RoPE's inv_freq)
        self.params.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in saved)

    def resolve(self, name: str) -> HFWeightTarget:
        if name in self.params:
            return HFWeightTarget(name)
        renamed = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral checkpoint names
        if renamed in self.params:
            return HFWeightTarget(renamed)
        match = _EXPERT.match(renamed)
        if match:
            attr, half = _FUSED_SLOT[match["proj"]]
            fused = f"{match['prefix']}.{attr}"
            if fused in self.params and int(match["expert"]) < self.params[fused].shape[0]:
                return HFWeightTarget(fused, int(match["expert"]), half)
        raise WeightUpdateError(
            f"unknown weight {name!r}: the engine's model has no such parameter (is the sender's model the same "
            f"architecture? e.g. it has {sorted(self.params)[:3]})"
        )

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Check every (name, tensor), then copy them all; returns the parameter names touched."""
        planned = []
        for name, tensor in named_tensors:
            target = self.resolve(name)
            dest = target.view(self.params[target.param_name])
            if tuple(tensor.shape) != tuple(dest.shape):
                raise WeightUpdateError(
                    f"weight {name!r} has shape {tuple(tensor.shape)} but the engine's {target.param_name} slot "
                    f"expects {tuple(dest.shape)}"
                )
            planned.append((target.param_name, dest, tensor))
        for _, dest, tensor in planned:
            dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))
        return {param_name for param_name, _, _ in planned}
