"""LoRA adapters on Megatron-Core's linear layers (Hu et al., arXiv 2106.09685): `y = W x + (α/r) · B A x`.

**Where.** The column- and row-parallel linear layers of the targets (`LoRAOptions.targets`): attention's QKV and
output projections, a dense layer's MLP, the shared experts and every routed expert's fc1/fc2; never a router.

**Slices.** A fused Megatron layer gets one adapter per Hugging Face projection it fuses, as peft puts one on each
HF module: QKV holds q, k and v adapters (each its own A; its B over that projection's rows, wherever Megatron's
grouped layout puts them), a dense fc1 holds gate and up. A routed expert's fc1 keeps one adapter over gate and up,
as peft does for transformers 5's fused `gate_up_proj`. The rows of each slice come from the family's weight
mapping (`WeightRule.to_megatron`), so no layout is written twice.

**Tensor parallelism**, with Megatron's own mappings. Column-parallel: A replicated, B sharded like the output;
the branch sees the layer's full input (`gather_from_sequence_parallel_region` under sequence parallelism, else
`copy_to_tensor_model_parallel_region`, whose backward sums the ranks' input gradients as the base layer's does),
and A passes `copy_to_tensor_model_parallel_region` so its gradient is summed over the ranks' B shards.
Row-parallel: A sharded like the input, B replicated; `x A_rᵀ` is summed over ranks
(`reduce_from_tensor_model_parallel_region`) before B, and under sequence parallelism the branch's output is split
over the sequence as the base layer's reduce-scatter splits its own. Routed experts communicate nothing (the
dispatcher moves their tokens); expert tensor parallelism is refused.

**Initialisation** is layout-free: A is drawn (Kaiming-uniform, peft's default) on the full matrix from a generator
seeded by the global parameter name, then sharded, so every layout starts from the same adapters; B = 0.

**dtype.** Adapters are fp32 and stay fp32 under Megatron's `Float16Module`, which casts the model to bf16:
`LoRASlices._apply` keeps their dtype (device moves still apply). The branch computes in fp32 and is cast to the
layer's output dtype.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_rl.config.options import LoRAOptions

# Module path suffixes (within a decoder layer) of each target.
_TARGETS = {
    "attention": ("self_attention.linear_qkv", "self_attention.linear_proj"),
    "mlp": ("mlp.linear_fc1", "mlp.linear_fc2"),
    "shared_experts": ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"),
    "experts": ("linear_fc1", "linear_fc2"),  # under mlp.experts.local_experts.{e}
}
_EXPERT_PATH = ".mlp.experts.local_experts."


@dataclass(frozen=True)
class SliceRows:
    """Slice j of a layer's local output rows: `local` (indices into this rank's rows, ascending) and `hf` (their
    row indices in the slice's HF projection)."""

    local: torch.Tensor
    hf: torch.Tensor


class LoRASlices(nn.Module):
    """The adapters of one linear layer: `B_j` `[rows_j(/tp), r]` per slice j, and `A_j` `[r, in(/tp)]` per slice
    or one A shared by every slice (a routed expert's fc1: one adapter over gate and up, its B kept as two slices
    so that each splits over expert tensor parallelism as a contiguous block)."""

    def __init__(self, a: list[torch.Tensor], b_rows: list[int], scale: float, rows: list[SliceRows] | None):
        super().__init__()
        self.A = nn.ParameterList([nn.Parameter(t.float()) for t in a])
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(n, a[0].shape[0])) for n in b_rows])
        self.scale = scale
        self.rows = rows  # None: one slice over every output row
        self._order = None if rows is None else torch.argsort(torch.cat([r.local for r in rows]))
        self.enabled = True
        # what the layer is (set by `install_lora`): its HF tensors, its kind
        self.column, self.expert, self.tp = True, False, False
        self.hf_names: tuple[str, ...] = ()
        self.local_rows: torch.Tensor | None = None  # one slice: this rank's rows of the full weight

    def _apply(self, fn, recurse=True):  # keep fp32 under Float16Module's cast; device moves still apply
        dtypes = [p.dtype for p in self.parameters()]
        super()._apply(fn, recurse)
        for p, dtype in zip(self.parameters(), dtypes, strict=True):
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
        return self

    def up(self, h: list[torch.Tensor], b: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`[..., out(/tp)]`: the slices' `B_j h_j` (`b`: the B's to use, default this module's), placed at their
        rows, times the scale."""
        bs = list(b if b is not None else self.B)
        outs = [hj @ bj.t() for hj, bj in zip(h * len(bs) if len(h) == 1 else h, bs, strict=True)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self._order is not None:
            out = out.index_select(-1, self._order.to(out.device))
        return out * self.scale

    def stacked_b(self) -> torch.Tensor:
        """`[out(/tp), r]`: the slices' B rows in the layer's output order (one A shared by every slice)."""
        out = self.B[0] if len(self.B) == 1 else torch.cat(list(self.B), dim=0)
        return out if self._order is None else out.index_select(0, self._order.to(out.device))

    def delta_weight(self) -> torch.Tensor:
        """`[out(/tp), in(/tp)]`: this rank's shard of `(α/r) · B A`, laid out as the layer's weight shard."""
        parts = [b @ self.A[min(j, len(self.A) - 1)] for j, b in enumerate(self.B)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if self._order is not None:
            out = out.index_select(0, self._order.to(out.device))
        return out * self.scale


def _tp(expert: bool = False) -> tuple[int, int]:
    """This rank's place in the (expert) tensor-parallel group."""
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _summed_grad(t: torch.Tensor, lora: LoRASlices) -> torch.Tensor:
    """`t` (an adapter replicated over the expert tensor-parallel group), its gradient summed over that group.

    A routed expert's layer communicates nothing itself: fc1's input is whole on every rank and its output rows
    are split, fc2's input is split and its output a partial sum the dispatcher reduces. The branch follows suit
    (fc2's `x_r A_rᵀ Bᵀ` is a partial sum too); only the replicated factor (fc1's A, fc2's B) needs its
    gradient, a partial on each rank, summed."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    if not (lora.expert and lora.tp):
        return t
    return mappings.copy_to_tensor_model_parallel_region(t, group=ps.get_expert_tensor_parallel_group())


def _column_forward(linear: Any, lora: LoRASlices, forward: Any):
    from megatron.core.tensor_parallel import mappings

    def run(input_, *args, **kwargs):
        output, bias = forward(input_, *args, **kwargs)
        if not lora.enabled:
            return output, bias
        x = input_
        tp = lora.tp and not lora.expert
        a = [_summed_grad(t, lora) for t in lora.A]
        if tp:
            x = (mappings.gather_from_sequence_parallel_region(x) if linear.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(x))  # fmt: skip
            a = [mappings.copy_to_tensor_model_parallel_region(t) for t in a]
        x = x.float()
        return output + lora.up([x @ t.t() for t in a]).to(output.dtype), bias

    return run


def _row_forward(linear: Any, lora: LoRASlices, forward: Any):
    from megatron.core.tensor_parallel import mappings

    def run(input_, *args, **kwargs):
        output, bias = forward(input_, *args, **kwargs)
        if not lora.enabled:
            return output, bias
        tp = lora.tp and not lora.expert
        h = input_.float() @ lora.A[0].t()
        if tp:
            h = mappings.reduce_from_tensor_model_parallel_region(h)
        delta = lora.up([h], b=[_summed_grad(lora.B[0], lora)])
        if tp and linear.sequence_parallel:
            delta = mappings.scatter_to_sequence_parallel_region(delta)
        return output + delta.to(output.dtype), bias

    return run


def grouped_delta(
    hidden: torch.Tensor, counts: torch.Tensor, linears: list[Any], grouped_linear: Any, gemm: str
) -> torch.Tensor | None:
    """The routed experts' adapter branch for the grouped experts (`layers.grouped_experts`): each expert's
    `(α/r) B_e A_e x` over its token group, in two grouped GEMMs; None without adapters (or with them off)."""
    adapters: list[Any] = [getattr(m, "lora", None) for m in linears]
    if adapters[0] is None or not adapters[0].enabled:
        return None
    x = hidden.float()
    replicated = adapters[0].column  # fc1: A whole on every expert-TP rank; fc2: B
    a = [_summed_grad(m.A[0], m) if replicated else m.A[0] for m in adapters]
    b = [m.stacked_b() if replicated else _summed_grad(m.B[0], m) for m in adapters]
    return grouped_linear(grouped_linear(x, counts, a, gemm), counts, b, gemm) * adapters[0].scale


def _kaiming_a(rank: int, fan_in: int, seed_name: str) -> torch.Tensor:
    """peft's default A: `kaiming_uniform_(a=√5)` on `[rank, fan_in]`, from a generator seeded by the name."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_ with a = √5: gain √(2/6), bound = gain · √(3/fan_in)
    return torch.empty(rank, fan_in).uniform_(-bound, bound, generator=gen)


def _slice_rows(rule: Any, local_ids: torch.Tensor, full_rows: int) -> list[SliceRows]:
    """Which of this rank's output rows (`local_ids`: their Megatron row ids) belong to each HF projection of the
    layer (`rule.hf`), and their rows there: Megatron's row ids split by the mapping's `to_hf`, in HF row order."""
    ids = torch.arange(full_rows, dtype=torch.float64).unsqueeze(1)
    slice_of = torch.empty(full_rows, dtype=torch.long)
    hf_row = torch.empty(full_rows, dtype=torch.long)
    for j, part in enumerate(rule.to_hf(ids)):
        rows = part.squeeze(1).long()
        slice_of[rows], hf_row[rows] = j, torch.arange(rows.numel())
    out = []
    for j in range(len(rule.hf)):
        local = (slice_of[local_ids] == j).nonzero().squeeze(1)
        local = local[torch.argsort(hf_row[local_ids[local]])]
        out.append(SliceRows(local, hf_row[local_ids[local]]))
    return out


def lora_modules(chunks: list[nn.Module]) -> Iterator[LoRASlices]:
    """Every adapter of the model chunks."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LoRASlices):
                yield module


@contextmanager
def adapters_off(chunks: list[nn.Module]) -> Iterator[None]:
    """Within the block the model computes with its base weights alone (the adapters' branch is skipped)."""
    adapters = list(lora_modules(chunks))
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True


def is_lora_param(name: str) -> bool:
    """Whether a parameter name (as `named_parameters` gives it) is an adapter's."""
    return ".lora." in f".{name}"


def _target(local_name: str, targets: tuple[str, ...]) -> str | None:
    """The target a linear layer's module path (`decoder.layers.{i}....`) belongs to, or None."""
    for target in targets:
        for suffix in _TARGETS[target]:
            if target == "experts":
                if _EXPERT_PATH in local_name and local_name.endswith("." + suffix):
                    return target
            elif local_name.endswith("." + suffix) and _EXPERT_PATH not in local_name:
                return target
    return None


def install_lora(chunks: list[nn.Module], options: LoRAOptions, weights: Any, global_name: Any, shard: Any) -> int:
    """Add adapters to the target layers of `chunks` (bare models, before DDP) and freeze every other parameter;
    returns the number of adapted layers. `global_name(chunk_index, local_name)`: a parameter's layout-free name
    (`hf_weights.local_params`' naming), which seeds A and finds the layer's weight rule in `weights`;
    `shard(full, param, rule)`: this rank's rows of a full tensor, as the weight is split (`hf_weights._shard`)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    adapted = 0
    for c, chunk in enumerate(chunks):
        for p in chunk.parameters():
            p.requires_grad_(False)
        for local_name, linear in list(chunk.named_modules()):
            column = isinstance(linear, ColumnParallelLinear)
            if not (column or isinstance(linear, RowParallelLinear)) or _target(local_name, options.targets) is None:
                continue
            name = global_name(c, f"{local_name}.weight")
            expert = _EXPERT_PATH in local_name
            rule = weights.rule(name)
            build = _column_adapter if column else _row_adapter
            lora = build(linear, options, name, rule, shard)
            lora.hf_names, lora.column, lora.expert = rule.hf, column, expert
            lora.tp = _tp(expert)[1] > 1
            for t in lora.parameters():
                t.data = t.data.to(linear.weight.device)
                if expert:  # reduced over the expert-data-parallel group, as Megatron marks the experts' weights
                    t.allreduce = getattr(linear.weight, "allreduce", True)  # type: ignore[attr-defined]
            linear.forward = (_column_forward if column else _row_forward)(linear, lora, linear.forward)
            linear.lora = lora
            adapted += 1
    if not adapted:  # e.g. Transformer Engine's layers, which these adapters do not wrap: nothing would train
        raise ValueError(f"model.lora.targets={list(options.targets)} matched no linear layer of the local spec")
    return adapted


def _column_adapter(linear: Any, options: LoRAOptions, name: str, rule: Any, shard: Any) -> LoRASlices:
    """A column-parallel layer's adapters: one per HF projection of `rule` (one for a routed expert), A replicated
    `[r, in]`, B over the slice's rows of this rank."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    expert = bool(linear.is_expert)
    weight = linear.weight
    tp = _tp(expert)[1] > 1
    full_rows = weight.shape[0] * (_tp(expert)[1] if tp else 1)
    ids = torch.arange(full_rows, dtype=torch.float64).unsqueeze(1)
    local_ids = shard(ids, weight, rule, expert=expert).squeeze(1).long()  # this rank's rows of the full weight
    slices = _slice_rows(rule, local_ids, full_rows) if len(rule.hf) > 1 else None
    shared = 1 if expert else len(slices or [0])  # a routed expert's fc1: one A over gate and up (peft's)
    a = [_kaiming_a(options.rank, weight.shape[1], f"{name}.lora_A.{j}") for j in range(shared)]
    b_rows = [weight.shape[0]] if slices is None else [int(s.local.numel()) for s in slices]
    lora = LoRASlices(a, b_rows, options.alpha / options.rank, slices)
    lora.local_rows = local_ids if slices is None else None
    if tp:
        for t in lora.B:
            set_tensor_model_parallel_attributes(t, True, 0, 1)
    return lora


def _row_adapter(linear: Any, options: LoRAOptions, name: str, rule: Any, shard: Any) -> LoRASlices:
    """A row-parallel layer's adapter: A `[r, in/tp]` (this rank's columns of the full A), B replicated."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    rank, size = _tp(bool(linear.is_expert))
    weight = linear.weight
    tp = size > 1
    full = _kaiming_a(options.rank, weight.shape[1] * (size if tp else 1), f"{name}.lora_A.0")
    lora = LoRASlices([full.chunk(size, dim=1)[rank] if tp else full], [weight.shape[0]], options.alpha / options.rank,
                      None)  # fmt: skip
    if tp:
        set_tensor_model_parallel_attributes(lora.A[0], True, 1, 1)
    return lora
