"""The actor's LoRA adapters in Hugging Face peft's format: `adapter_config.json` + `adapter_model.safetensors`,
with the names and layouts peft itself gives the transformers model (peft 0.21, transformers 5).

* A projection Megatron fuses gets one peft module per HF projection: QKV -> `q_proj`, `k_proj`, `v_proj`; a dense
  fc1 -> `gate_proj`, `up_proj`; names are the family's HF weight names without `.weight`.
* Routed experts: transformers 5 stores them fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj`
  `[E, H, I]`), which peft adapts with `target_parameters`: one `ParamWrapper` per parameter, the first
  (gate_up_proj) nested as `base_layer` of the second. Each has `lora_A` `[E·r, in]` (expert e's rows
  `e·r .. e·r+r`) and `lora_B` `[out, r·E]` (expert e's column k at `k·E + e`), as peft's `ParamWrapper`
  reshapes them (`get_delta_weight`: A `(e, r, in)`, B `(out, r, e)`).
* A shared A (`LoRAOptions.share_expert_a`) is expanded: every expert's rows of `lora_A` hold a copy of it.

Collective: every rank contributes its adapters (its tensor-parallel shards, its pipeline stage's layers, its
experts); rank 0 assembles the full tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.megatron_backend.lora.adapters import LoRASlices, lora_modules

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_EXPERT_HF = re.compile(r"^(?P<path>.*\.experts)\.(?P<e>\d+)\.")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # peft's nesting order: first = inner
_MOE_RENAMED = ("gate_proj", "up_proj", "down_proj")  # names peft 0.21 maps to fused experts on transformers 5


def _pieces(lora: LoRASlices, value: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple]:
    """This rank's part of one layer's adapters for `_assemble`: `(module, "A"|"B", expert, slice, place, tensor)`
    with `place` None (whole), a tensor of rows (B split by rows) or a column offset (A split by columns)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_expert_tensor_parallel_rank() if lora.expert else ps.get_tensor_model_parallel_rank()
    expert: int | None = None
    if lora.expert:  # one module per layer's experts (peft's fused layout)
        match = _EXPERT_HF.match(lora.hf_names[0])
        assert match is not None, lora.hf_names[0]
        module, expert = match["path"] + (".base_layer" if lora.column else ""), int(match["e"])
    out: list[tuple] = []
    for j, b in enumerate(lora.B):
        a = lora.A[min(j, len(lora.A) - 1)]
        part = j  # a layer's experts: gate and up are parts of one peft tensor
        if not lora.expert:  # one peft module per HF projection
            module, part = lora.hf_names[j].removesuffix(".weight"), 0
        if lora.column:
            out.append((module, "A", expert, 0, None, value(a)))
            out.append((module, "B", expert, part, lora.rows[j].hf if lora.rows else lora.local_rows, value(b)))
        else:
            out.append((module, "A", expert, 0, tp_rank * a.shape[1] if lora.tp else None, value(a)))
            out.append((module, "B", expert, 0, None, value(b)))
    return out


def _assemble(pieces: list[tuple], num_experts: int) -> dict[str, torch.Tensor]:
    """peft's state dict from every rank's pieces."""
    parts: dict[tuple, list] = {}
    for module, which, expert, j, place, tensor in pieces:
        parts.setdefault((module, which, expert, j), []).append((place, tensor))
    full: dict[tuple, torch.Tensor] = {}
    for key, items in parts.items():
        place = items[0][0]
        if place is None:  # held whole (replicated over tensor parallelism)
            full[key] = items[0][1]
        elif isinstance(place, torch.Tensor):  # B split by rows: each piece's rows of the full tensor
            full[key] = torch.zeros(max(int(w.max()) for w, _ in items) + 1, items[0][1].shape[1])
            for w, t in items:
                full[key][w] = t
        else:  # A split by input columns
            by_offset = {off: t for off, t in items}
            full[key] = torch.cat([by_offset[off] for off in sorted(by_offset)], dim=1)
    out = {}
    for module, which in sorted({(k[0], k[1]) for k in full}):
        if (module, which, None, 0) in full:
            tensor = full[module, which, None, 0]
        else:  # a layer's experts, as peft's ParamWrapper holds them: A [E·r, in] expert-major, B [out, r·E]
            slices = sorted({k[3] for k in full if k[:2] == (module, which)})
            per_expert = [torch.cat([full[module, which, e, j] for j in slices]) for e in range(num_experts)]
            stacked = torch.stack(per_expert)
            tensor = stacked.reshape(-1, stacked.shape[-1]) if which == "A" else stacked.permute(1, 2, 0).reshape(
                stacked.shape[1], -1
            )
        out[f"base_model.model.{module}.lora_{which}.weight"] = tensor.contiguous()
    return out


def peft_state_dict(
    chunks: list[Any], num_experts: int, value: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """The adapters of `chunks` as peft names them, on rank 0 (None elsewhere). Collective. `value(param)`: what
    to take of each adapter parameter (default: its value; e.g. its gradient)."""
    take = value or (lambda p: p.detach())
    mine = [piece for lora in lora_modules(chunks) for piece in _pieces(lora, lambda p: take(p).float().cpu())]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
        if rank != 0:
            return None
        mine = [piece for part in gathered for piece in part]
    return _assemble(mine, num_experts)


def adapter_config(options: Any, state: dict[str, torch.Tensor], base_model: str, for_peft: bool) -> dict[str, Any]:
    """`adapter_config.json` for `state`: the adapted modules by full name, routed experts as peft's
    `target_parameters`. `for_peft`: refuse what peft would load wrongly (else the file is for this package)."""
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in state})
    experts = any(m.endswith(".experts") or m.endswith(".experts.base_layer") for m in modules)
    dense_mlp = [m for m in modules if m.rsplit(".", 1)[-1] in _MOE_RENAMED]
    if for_peft and experts and dense_mlp:
        raise ValueError(
            f"adapters on a dense layer's MLP ({dense_mlp[0]}, ...) cannot be written for peft beside the routed "
            "experts': on transformers 5, peft maps the names gate_proj/up_proj/down_proj to the fused experts, so "
            "it would load them nowhere; train with model.lora.targets without mlp, or export the merged model"
        )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": options.rank,
        "lora_alpha": options.alpha,
        "lora_dropout": options.dropout,
        "bias": "none",
        "target_modules": [m for m in modules if ".experts" not in m],
        "target_parameters": list(EXPERT_PARAMETERS) if experts else None,
    }


def save_peft_adapter(
    chunks: list[Any], options: Any, num_experts: int, out_dir: Path, base_model: str, *, for_peft: bool = True
) -> None:
    """Write the adapters of `chunks` as a peft adapter directory (rank 0 writes). Collective. `for_peft=False`:
    also what peft cannot load (a dense MLP's adapters beside the experts'), for `load_peft_adapter`."""
    from safetensors.torch import save_file

    state = peft_state_dict(chunks, num_experts)
    if state is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / ADAPTER_WEIGHTS))
    config = adapter_config(options, state, base_model, for_peft)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def load_peft_adapter(chunks: list[Any], options: Any, num_experts: int, adapter_dir: str | Path) -> int:
    """Set the adapters of `chunks` from a peft adapter directory (as `save_peft_adapter` writes it, or peft
    saves it for the transformers model): every rank takes its shards of the full tensors. Refuses an adapter of
    another rank or alpha, one that lacks a tensor of these adapters, or (`share_expert_a`) one whose experts'
    A differ; returns the tensors read."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("r") != options.rank or float(config.get("lora_alpha", 0)) != float(options.alpha):
        raise ValueError(
            f"{adapter_dir}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')} but model.lora has "
            f"rank={options.rank}, alpha={options.alpha}: set model.lora to the adapter's values"
        )
    state = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    used: set[str] = set()

    def full(module: str, which: str, shared: bool = False) -> torch.Tensor:
        key = f"base_model.model.{module}.lora_{which}.weight"
        if key not in state:
            raise ValueError(f"{adapter_dir} has no {key}: it does not adapt the layers model.lora.targets names")
        if shared and key not in used:  # every expert's A must be the one the model's experts share
            per_expert = state[key].reshape(num_experts, options.rank, -1)
            if not torch.equal(per_expert, per_expert[:1].expand_as(per_expert)):
                raise ValueError(f"{adapter_dir}: {module} has a different lora_A per expert, but "
                                 "model.lora.share_expert_a shares one: load it with share_expert_a=false")  # fmt: skip
        used.add(key)
        return state[key].float()

    for lora in lora_modules(chunks):
        for (module, which, expert, j, place, _), param in zip(_pieces(lora, lambda p: p), _params(lora), strict=True):
            tensor = full(module, which, shared=expert is not None and which == "A" and lora.shared_a)
            if expert is not None:  # peft's ParamWrapper layout back to expert `expert`'s A or B
                rank = options.rank
                tensor = tensor[expert * rank : (expert + 1) * rank] if which == "A" else tensor[:, expert::num_experts]
                if which == "B" and len(lora.B) > 1:  # gate and up rows of one B over both
                    tensor = tensor.chunk(len(lora.B), dim=0)[j]
            if isinstance(place, torch.Tensor):
                tensor = tensor[place]
            elif isinstance(place, int):
                tensor = tensor[:, place : place + param.shape[1]]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{adapter_dir}: {module} lora_{which} gives {tuple(tensor.shape)} for this rank's "
                                 f"{tuple(param.shape)}")  # fmt: skip
            param.copy_(tensor)
    return len(used)


def _params(lora: LoRASlices) -> list[torch.Tensor]:
    """The parameters `_pieces` describes, in its order (A then B of each slice)."""
    out = []
    for j, b in enumerate(lora.B):
        out += [lora.A[min(j, len(lora.A) - 1)], b]
    return out
