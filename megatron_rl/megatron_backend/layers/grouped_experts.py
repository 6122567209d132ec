"""The local spec's MoE experts computed all at once: Megatron's `SequentialMLP` with a grouped forward.

Megatron-Core's local spec builds a MoE layer's experts as `SequentialMLP` (transformer/moe/experts.py): one
`MLP` per local expert, run in a Python loop over the expert's slice of the permuted tokens. On CPU, at the
sizes RL fine-tuning runs there, that loop is a third of the forward-backward (docs/performance.md, "The experts
computed all at once").
`grouped_mlp_class()` is the same module -- a subclass with exactly its parameters, names and
`sharded_state_dict`, so checkpoints, HF conversion, weight sync and the families' mappings do not change --
whose forward runs each projection of all local experts at once: one grouped GEMM
(`torch.nn.functional.grouped_mm`, the kernel transformers 5 uses for its MoE experts, `integrations/moe.py`)
over the token groups, forward and backward, on CPU and on CUDA; a loop of bare matmuls only where that kernel
cannot run or, on CPU, where stacking the weights would cost more (`_grouped_linear`); and every elementwise step
once over all tokens. Each group's matmul is the one `SequentialMLP`'s linear layers compute, so on SwiGLU experts
the outputs and gradients are bitwise those of `SequentialMLP`; with expert biases or GPT-OSS's gate they agree
to fp32 rounding (tests/megatron_backend/layers/test_grouped_experts.py).

The forward is `MLP.forward` (transformer/mlp.py, megatron-core 0.16 and 0.19 alike) on the unfused path:
fc1 (+ bias), the gated linear unit with the config's activation, clamp and linear offset (or the plain
activation), the per-token routing probability, fc2, and fc2's bias scaled by that probability. The experts'
linear layers communicate nothing whatever the layout (with expert TP or EP > 1 they are `explicit_expert_comm`,
the token dispatcher moves the tokens; otherwise their groups are of one rank), so the same local matmuls hold
under expert tensor and expert parallelism. What that path does not cover -- the fused bias-activation kernels,
Transformer Engine's activation module, FP8/FP4 padding, delayed weight-gradient computation -- is refused by
`grouped_unsupported_reason`, and `model.options.experts=auto` then keeps `SequentialMLP`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.lora.adapters import grouped_delta


def grouped_unsupported_reason(config: Any) -> str | None:
    """Why the grouped experts cannot compute what `SequentialMLP` computes for this `TransformerConfig`, or
    None when they can."""
    for flag in ("bias_activation_fusion", "use_te_activation_func", "fp8", "fp4", "delay_wgrad_compute"):
        if getattr(config, flag, None):
            return f"{flag}={getattr(config, flag)!r} (only the unfused MLP path is grouped)"
    return None


@functools.cache
def grouped_mlp_class() -> type:
    """`GroupedSequentialMLP`, built on first use (Megatron is imported lazily)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedSequentialMLP(SequentialMLP):
        """`SequentialMLP` whose forward computes all local experts at once (module docstring)."""

        # How each projection's matmuls run: "auto" (`_grouped_linear`'s rule), or forced "grouped_mm" / "loop"
        # (the benchmark sets it on an instance to measure both).
        gemm: str = "auto"

        def forward(
            self,
            permuted_local_hidden_states: torch.Tensor,
            tokens_per_expert: torch.Tensor,
            permuted_probs: torch.Tensor,
        ) -> tuple[torch.Tensor, None]:
            """Outputs of the tokens, grouped by expert as `tokens_per_expert` says; no separate bias."""
            config = self.config
            hidden, probs = permuted_local_hidden_states, permuted_probs
            if config.moe_apply_probs_on_input:  # as SequentialMLP.forward: scale the input, not the output
                assert config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
                hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
                probs = torch.ones_like(probs)
            counts = torch.as_tensor(tokens_per_expert, device=hidden.device)
            fc1 = [expert.linear_fc1 for expert in self.local_experts]
            fc2 = [expert.linear_fc2 for expert in self.local_experts]

            inter = _grouped_linear(hidden, counts, [m.weight for m in fc1], self.gemm)
            if (delta := grouped_delta(hidden, counts, fc1, _grouped_linear, self.gemm)) is not None:
                inter = inter + delta.to(inter.dtype)  # LoRA (`lora/adapters.py`)
            if fc1[0].bias is not None:
                inter = inter + _per_token(torch.stack([m.bias for m in fc1]), counts, inter.shape[0])
            if config.gated_linear_unit:
                x_glu, x_linear = torch.chunk(inter, 2, dim=-1)
                if (val := config.activation_func_clamp_value) is not None:
                    x_glu = x_glu.clamp(min=None, max=val)
                    x_linear = x_linear.clamp(min=-val, max=val)
                inter = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
            else:
                inter = config.activation_func(inter)
            inter = (inter * probs.unsqueeze(-1)).to(inter.dtype)

            output = _grouped_linear(inter, counts, [m.weight for m in fc2], self.gemm)
            if (delta := grouped_delta(inter, counts, fc2, _grouped_linear, self.gemm)) is not None:
                output = output + delta.to(output.dtype)
            if fc2[0].bias is not None:
                bias = _per_token(torch.stack([m.bias for m in fc2]), counts, output.shape[0])
                output = output + bias * probs.unsqueeze(-1)
            return output, None

    return GroupedSequentialMLP


def with_grouped_experts(block: Any) -> Any:
    """A copy of a decoder block spec whose MoE layers build `grouped_mlp_class()` where they built
    `SequentialMLP` (the local spec). Specs are `ModuleSpec`s, or on megatron-core 0.19 `functools.partial`s of
    the module class; both are rebuilt, never edited (Megatron shares them between layers)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    def swap_experts(spec: Any) -> Any:
        if _module(spec) is SequentialMLP:
            return _rebuilt(spec, module=grouped_mlp_class())
        submodules = _submodules(spec)
        for name in ("mlp", "experts"):
            child = getattr(submodules, name, None)
            if child is not None and (new := swap_experts(child)) is not child:
                return _rebuilt(spec, submodules=dataclasses.replace(submodules, **{name: new}))
        return spec

    return dataclasses.replace(block, layer_specs=[swap_experts(layer) for layer in block.layer_specs])


def _module(spec: Any) -> Any:
    """The class a spec builds: a `ModuleSpec`'s `module`, a `functools.partial`'s function."""
    return spec.func if isinstance(spec, functools.partial) else getattr(spec, "module", None)


def _submodules(spec: Any) -> Any:
    """A spec's submodules: a `ModuleSpec`'s field, a `functools.partial`'s `submodules` keyword."""
    return spec.keywords.get("submodules") if isinstance(spec, functools.partial) else getattr(spec, "submodules", None)


def _rebuilt(spec: Any, *, module: Any = None, submodules: Any = None) -> Any:
    """A copy of `spec` building `module` and/or with `submodules` (None: unchanged)."""
    if isinstance(spec, functools.partial):
        keywords = spec.keywords if submodules is None else {**spec.keywords, "submodules": submodules}
        return functools.partial(module or spec.func, *spec.args, **keywords)
    changes = {"module": module, "submodules": submodules}
    return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not None})


# On CPU, the most bytes of one projection's stacked expert weights for which the grouped GEMM is taken. The stack
# and the weight gradient are two tensors of that size per call; glibc's malloc serves blocks of 32 MiB and more
# with a fresh mmap each time, so above it every call page-faults all of them in (measured on one thread: stacking
# 28 MiB 3.7 ms, 32 MiB 18.5 ms with 8,193 page faults), and the loop of plain matmuls, which allocates nothing of
# that size, is faster (benchmarks/bench_grouped_experts.py, docs/performance.md "The experts computed all at once").
CPU_STACK_MAX_BYTES = 30 << 20
# On CPU, the most bytes of one expert's weight for which the grouped GEMM is taken. Stacking copies every expert's
# weight on every call, while the loop costs one matmul dispatch per expert: at the demo's 16 KiB per expert the two
# are even; from BENCH_SPEC's 256 KiB the loop is as fast or faster, and at hidden 384 with 32 experts (576 KiB)
# an update of the trainer's micro-batch takes 6-16% less time with it (benchmarks/bench_experts_gemm.py).
CPU_EXPERT_MAX_BYTES = 64 << 10


def _grouped_linear(
    x: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor], gemm: str = "auto"
) -> torch.Tensor:
    """`x @ W_e.T` for each expert e's group of rows of `x` (`counts[e]` rows each, in expert order).

    The grouped GEMM: `torch.nn.functional.grouped_mm` over the stacked weights, forward and backward one call
    each, no per-expert Python (on CUDA the CUTLASS/cuBLASLt grouped kernels where torch has them, else torch's
    loop of `mm_out` in C++; on CPU that loop). The loop of plain matmuls remains where the grouped GEMM cannot run
    (`_grouped_mm_runs`) or, on CPU, where stacking the weights every call costs more than it saves
    (`CPU_EXPERT_MAX_BYTES`, `CPU_STACK_MAX_BYTES`). Both compute each group with the matmul `SequentialMLP`'s
    linear layers use, bitwise. `gemm` forces one ("grouped_mm", "loop") for the benchmark."""
    if gemm == "grouped_mm" or (gemm == "auto" and _grouped_mm_runs(x, weights)):
        return _GroupedLinear.apply(x, torch.cumsum(counts, 0, dtype=torch.int32), *weights)
    groups = x.split(counts.tolist())
    return torch.cat([torch.nn.functional.linear(group, w) for group, w in zip(groups, weights, strict=True)])


class _GroupedLinear(torch.autograd.Function):
    """`x @ W_e.T` per group as one grouped GEMM, and its backward as two: the input's gradient against the stacked
    weights, every expert's weight gradient at once as `[experts, out, in]`, so each expert's gradient is a
    contiguous slice that autograd hands to the parameter without a copy (autograd's own derivative of
    `grouped_mm` over the transposed stack gives transposed slices, which it then copies per expert). The stacked
    weights are kept for the backward: one copy of the layer's local expert weights per pass in flight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(weights)  # [experts, out, in]
        ctx.save_for_backward(x, offsets, stacked)
        return torch.nn.functional.grouped_mm(x, stacked.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offsets, stacked = ctx.saved_tensors
        grad = grad.contiguous()  # the grouped GEMM needs 16-byte-aligned rows; the output's were
        grad_x = torch.nn.functional.grouped_mm(grad, stacked, offs=offsets) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):
            return (grad_x, None, *[None] * stacked.shape[0])
        grad_w = torch.nn.functional.grouped_mm(grad.t(), x, offs=offsets)  # each group's grad.T @ x
        return (grad_x, None, *grad_w.unbind(0))


def _grouped_mm_runs(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `_grouped_linear` takes the grouped GEMM: a device torch's grouped GEMM supports (CPU; CUDA from
    compute capability 8.0, as transformers checks), the 16-byte alignment it requires of the rows of `x`, of the
    weights and of the output (and of the output's gradient in the backward), and on CPU each expert's weight at
    most `CPU_EXPERT_MAX_BYTES` and the stacked weights at most `CPU_STACK_MAX_BYTES`."""
    device = x.device
    if device.type == "cuda":
        if platform.device_capability(device) < (8, 0):
            return False
    elif device.type != "cpu":
        return False
    w = weights[0]
    aligned = 16 // x.element_size()
    if x.data_ptr() % 16 or x.stride(0) % aligned or w.shape[0] % aligned or w.shape[1] % aligned:
        return False
    if device.type != "cpu":
        return True
    expert_bytes = w.numel() * w.element_size()
    return expert_bytes <= CPU_EXPERT_MAX_BYTES and len(weights) * expert_bytes <= CPU_STACK_MAX_BYTES


def _per_token(per_expert: torch.Tensor, counts: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's row of a per-expert tensor (`[experts, ...]`), tokens grouped by expert."""
    return per_expert.repeat_interleave(counts, dim=0, output_size=num_tokens)
