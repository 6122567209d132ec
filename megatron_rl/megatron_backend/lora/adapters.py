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
dispatcher moves their tokens); under expert tensor parallelism only a replicated factor's gradient is summed.

**Shared A** (`LoRAOptions.share_expert_a`): a MoE layer's routed experts share one A for fc1 and one for fc2
(`SharedExpertA`, on the MoE layer), each expert keeps its B. Every expert-parallel rank holds a replica; its
gradient (from that rank's experts alone) is summed over the expert-parallel group in the backward pass, then
reduced over expert data parallelism by Megatron's DDP as an expert parameter (`allreduce=False`). Marking it
dense instead would reduce it over the dense data-parallel group, which covers the expert-parallel ranks only when
expert TP equals TP (the layout test's TP=2 x EP=2 with expert TP 1 tells them apart). The replicas beyond the first
expert-parallel rank are `shared` (Megatron's flag for a copy of a parameter another rank holds), so the gradient
norm counts the A once (and once over expert TP: `training_setup.count_expert_grads_by_expert_tp`).

**Initialisation** is layout-free: A is drawn (Kaiming-uniform, peft's default) on the full matrix from a generator
seeded by the global parameter name (a shared A's: the layer's, without an expert index), then sharded, so
every layout starts from the same adapters; B = 0.

**dtype.** Adapters are fp32 and stay fp32 under Megatron's `Float16Module`, which casts the model to bf16:
`_Fp32Adapters._apply` keeps their dtype (device moves still apply). The branch computes in fp32 and is cast to the
layer's output dtype.
"""

from __future__ import annotations

import math
import re
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
_EXPERT_INDEX = re.compile(r"\.local_experts\.\d+\.")


@dataclass(frozen=True)
class SliceRows:
    """Slice j of a layer's local output rows: `local` (indices into this rank's rows, ascending) and `hf` (their
    row indices in the slice's HF projection)."""

    local: torch.Tensor
    hf: torch.Tensor


class _Fp32Adapters(nn.Module):
    """Adapter parameters that keep their dtype (fp32) under Float16Module's cast; device moves still apply."""

    def _apply(self, fn, recurse=True):
        dtypes = [p.dtype for p in self.parameters()]
        super()._apply(fn, recurse)
        for p, dtype in zip(self.parameters(), dtypes, strict=True):
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
        return self


class SharedExpertA(_Fp32Adapters):
    """The A's a MoE layer's routed experts share (`LoRAOptions.share_expert_a`), on the MoE layer as `lora`:
    `fc1` `[r, hidden]` (replicated over expert TP) and `fc2` `[r, moe_ffn(/etp)]`."""

    expert = True  # split, where split, over expert tensor parallelism


class LoRASlices(_Fp32Adapters):
    """The adapters of one linear layer: `B_j` `[rows_j(/tp), r]` per slice j, and `A_j` `[r, in(/tp)]` per slice
    or one A shared by every slice (a routed expert's fc1: one adapter over gate and up, its B kept as two slices
    so that each splits over expert tensor parallelism as a contiguous block). `shared_a`: a routed expert's A
    when its layer's experts share it (`SharedExpertA` holds it; here it is used, not registered)."""

    def __init__(
        self,
        a: list[torch.Tensor],
        b_rows: list[int],
        scale: float,
        rows: list[SliceRows] | None,
        shared_a: nn.Parameter | None = None,
    ):
        super().__init__()
        self.A: nn.ParameterList | list[nn.Parameter] = (
            [shared_a] if shared_a is not None else nn.ParameterList([nn.Parameter(t.float()) for t in a])
        )
        self.shared_a = shared_a is not None
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(n, self.A[0].shape[0])) for n in b_rows])
        self.scale = scale
        self.rows = rows  # None: one slice over every output row
        self._order = None if rows is None else torch.argsort(torch.cat([r.local for r in rows]))
        self.enabled = True
        # what the layer is (set by `install_lora`): its HF tensors, its kind
        self.column, self.expert, self.tp = True, False, False
        self.hf_names: tuple[str, ...] = ()
        self.local_rows: torch.Tensor | None = None  # one slice: this rank's rows of the full weight

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


def _summed_grad(t: torch.Tensor, lora: LoRASlices, shared: bool = False) -> torch.Tensor:
    """`t` (a routed expert's adapter held alike on several ranks), its gradient summed over them.

    A routed expert's layer communicates nothing itself: fc1's input is whole on every rank and its output rows
    are split, fc2's input is split and its output a partial sum the dispatcher reduces. The branch follows suit
    (fc2's `x_r A_rᵀ Bᵀ` is a partial sum too); only the factor replicated over expert TP (fc1's A, fc2's B)
    needs its gradient, a partial on each rank, summed over that group. `shared`: `t` is its layer's shared A,
    held by the ranks of the other experts too: summed over expert TP and EP (fc1) or EP alone (fc2's, split
    over expert TP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    if shared:
        group = ps.get_expert_tensor_and_model_parallel_group() if lora.column else ps.get_expert_model_parallel_group()
    elif lora.expert and lora.tp:
        group = ps.get_expert_tensor_parallel_group()
    else:
        return t
    if group.size() == 1:
        return t
    return mappings.copy_to_tensor_model_parallel_region(t, group=group)


def _column_forward(linear: Any, lora: LoRASlices, forward: Any):
    from megatron.core.tensor_parallel import mappings

    def run(input_, *args, **kwargs):
        output, bias = forward(input_, *args, **kwargs)
        if not lora.enabled:
            return output, bias
        x = input_
        tp = lora.tp and not lora.expert
        a = [_summed_grad(t, lora, lora.shared_a) for t in lora.A]
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
        h = input_.float() @ (_summed_grad(lora.A[0], lora, True) if lora.shared_a else lora.A[0]).t()
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
    `(α/r) B_e A_e x` over its token group, in two grouped GEMMs (a shared A: one GEMM over every token); None
    without adapters (or with them off)."""
    adapters: list[Any] = [getattr(m, "lora", None) for m in linears]
    first = adapters[0]
    if first is None or not first.enabled:
        return None
    x = hidden.float()
    replicated = first.column  # fc1: A whole on every expert-TP rank; fc2: B
    if first.shared_a:
        h = x @ _summed_grad(first.A[0], first, shared=True).t()
    else:
        h = grouped_linear(x, counts, [_summed_grad(m.A[0], m) if replicated else m.A[0] for m in adapters], gemm)
    b = [m.stacked_b() if replicated else _summed_grad(m.B[0], m) for m in adapters]
    return grouped_linear(h, counts, b, gemm) * first.scale


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


def adapter_params(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """Every adapter parameter of the model chunks, once (a shared A too)."""
    return [p for chunk in chunks for name, p in chunk.named_parameters() if is_lora_param(name)]


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

    if options.share_expert_a and "experts" not in options.targets:
        raise ValueError(f"model.lora.share_expert_a shares the routed experts' A, but model.lora.targets="
                         f"{list(options.targets)} has no experts: add experts or drop share_expert_a")  # fmt: skip
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
            shared = None
            if expert and options.share_expert_a:
                shared = _shared_expert_a(chunk, local_name, name, options.rank, linear, column)
            build = _column_adapter if column else _row_adapter
            lora = build(linear, options, name, rule, shard, shared)
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


def _shared_expert_a(
    chunk: nn.Module, local_name: str, name: str, rank: int, linear: Any, column: bool
) -> nn.Parameter:
    """The A that the routed experts of `linear`'s MoE layer share for fc1 (`column`) or fc2: made when the
    layer's first local expert asks, kept on the MoE layer (`SharedExpertA`), drawn from the layer's name (no
    expert index) on the full matrix and split over expert TP as any row-parallel A (module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    layer = chunk.get_submodule(local_name.split(".experts.local_experts.")[0])
    holder = getattr(layer, "lora", None)
    if holder is None:
        holder = layer.lora = SharedExpertA()
    key = "fc1" if column else "fc2"
    if not hasattr(holder, key):
        etp_rank, etp = _tp(expert=True)
        split = not column and etp > 1
        seed = f"{_EXPERT_INDEX.sub('.', name)}.lora_A.shared"
        full = _kaiming_a(rank, linear.weight.shape[1] * (etp if split else 1), seed)
        param = nn.Parameter((full.chunk(etp, dim=1)[etp_rank] if split else full).to(linear.weight.device))
        if split:
            set_tensor_model_parallel_attributes(param, True, 1, 1)
        param.allreduce = getattr(linear.weight, "allreduce", True)  # type: ignore[attr-defined]
        param.shared = ps.get_expert_model_parallel_rank() > 0  # type: ignore[attr-defined]
        setattr(holder, key, param)
    return getattr(holder, key)


def _column_adapter(
    linear: Any, options: LoRAOptions, name: str, rule: Any, shard: Any, shared_a: nn.Parameter | None = None
) -> LoRASlices:
    """A column-parallel layer's adapters: one per HF projection of `rule` (one for a routed expert), A replicated
    `[r, in]` (or the layer's `shared_a`), B over the slice's rows of this rank."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    expert = bool(linear.is_expert)
    weight = linear.weight
    tp = _tp(expert)[1] > 1
    full_rows = weight.shape[0] * (_tp(expert)[1] if tp else 1)
    ids = torch.arange(full_rows, dtype=torch.float64).unsqueeze(1)
    local_ids = shard(ids, weight, rule, expert=expert).squeeze(1).long()  # this rank's rows of the full weight
    slices = _slice_rows(rule, local_ids, full_rows) if len(rule.hf) > 1 else None
    count = 0 if shared_a is not None else 1 if expert else len(slices or [0])  # expert fc1: one A over gate, up
    a = [_kaiming_a(options.rank, weight.shape[1], f"{name}.lora_A.{j}") for j in range(count)]
    b_rows = [weight.shape[0]] if slices is None else [int(s.local.numel()) for s in slices]
    lora = LoRASlices(a, b_rows, options.alpha / options.rank, slices, shared_a)
    lora.local_rows = local_ids if slices is None else None
    if tp:
        for t in lora.B:
            set_tensor_model_parallel_attributes(t, True, 0, 1)
    return lora


def _row_adapter(
    linear: Any, options: LoRAOptions, name: str, rule: Any, shard: Any, shared_a: nn.Parameter | None = None
) -> LoRASlices:
    """A row-parallel layer's adapter: A `[r, in/tp]` (this rank's columns of the full A; or the layer's
    `shared_a`), B replicated."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    rank, size = _tp(bool(linear.is_expert))
    weight = linear.weight
    if shared_a is not None:
        return LoRASlices([], [weight.shape[0]], options.alpha / options.rank, None, shared_a)
    tp = size > 1
    full = _kaiming_a(options.rank, weight.shape[1] * (size if tp else 1), f"{name}.lora_A.0")
    lora = LoRASlices([full.chunk(size, dim=1)[rank] if tp else full], [weight.shape[0]], options.alpha / options.rank,
                      None)  # fmt: skip
    if tp:
        set_tensor_model_parallel_attributes(lora.A[0], True, 1, 1)
    return lora
