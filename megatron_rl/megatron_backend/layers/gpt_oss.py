"""GPT-OSS's layer code on Megatron-Core: the decoder block spec, with attention whose learnable sinks carry
their tensor-parallel attributes and an expert fc2 that biased experts need (`megatron_rl/models/gpt_oss.py` is the
family: its config and weight names)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from megatron_rl.megatron_backend.platform.mcore_compat import spec_submodules, spec_with_submodules


@functools.cache
def local_spec_modules() -> tuple[type, type]:
    """The two local-spec modules GPT-OSS needs in place of Megatron's (classes built once, on first use):
    attention with proper sinks, and the experts' fc2 whose output Megatron may add the bias to in place."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear, set_tensor_model_parallel_attributes
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SinkDotProductAttention(DotProductAttention):
        """Megatron's local attention with its learnable sinks (`softmax_offset`, this rank's heads) made like
        every other parameter. Megatron creates them (dot_product_attention.py, `softmax_type == "learnable"`)
        per partition but without the tensor-parallel attribute, so weight loading would treat them as replicated
        and the gradient norm would count only TP rank 0's; and on `torch.cuda.current_device()` explicitly, so a
        model built on the meta device (the converters) would get real, randomly initialised sinks."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            sinks: Any = getattr(self, "softmax_offset")  # noqa: B009 (mypy cannot type Megatron's attribute)
            if not isinstance(sinks, torch.nn.Parameter):
                return
            if torch.empty(0).device.type == "meta":  # built under `torch.device("meta")`
                sinks = self.softmax_offset = torch.nn.Parameter(torch.empty_like(sinks, device="meta"))
            set_tensor_model_parallel_attributes(sinks, is_parallel=True, dim=0, stride=1)

    class ExpertFc2(RowParallelLinear):
        """Megatron's expert fc2 (RowParallelLinear, tensor_parallel/layers.py) with two fixes for biased experts.

        1. Its output is safe to modify in place. Without expert parallelism (expert TP 1), RowParallelLinear
           returns the matmul through a no-op reduction autograd Function (tensor_parallel/mappings.py: a group of
           one returns its input), which autograd marks as a view; Megatron's expert MLP then adds the bias in
           place (transformer/mlp.py, `output += output_bias * per_token_scale`) and the backward pass refuses it.
        2. Its bias carries the attributes of what it is, a tensor split over the expert tensor-parallel group
           (always of one rank: Megatron refuses biased experts otherwise). As built it is tagged
           `sequence_parallel` whenever the config is, so finalize_model_grads sums its gradient over the dense
           tensor-parallel group (with EP=2 that adds another expert's gradient, without EP it doubles it); and it
           is not tagged `tensor_model_parallel`, so the gradient norm counts it on dense-TP rank 0 only
           (tensor_parallel/layers.py `param_is_not_tensor_parallel_duplicate`), leaving out the experts other
           ranks hold."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.bias is not None:
                self.bias.sequence_parallel = False
                set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=1)

        def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            output, bias = super().forward(*args, **kwargs)
            if not self.explicit_expert_comm and torch.is_grad_enabled():
                output = output.clone()
            return output, bias

    return SinkDotProductAttention, ExpertFc2


def _local_layer(spec: Any, core_attention: type, expert_fc2: type) -> Any:
    """A local-spec layer spec with GPT-OSS's core attention and expert fc2."""
    layer = spec_submodules(spec)
    experts = spec_with_submodules(spec_submodules(layer.mlp).experts, linear_fc2=expert_fc2)
    return spec_with_submodules(
        spec,
        self_attention=spec_with_submodules(layer.self_attention, core_attention=core_attention),
        mlp=spec_with_submodules(layer.mlp, experts=experts),
    )


def gpt_oss_block_spec(config: Any, use_te: bool, vp_stage: int | None) -> Any:
    """Megatron's GPT decoder block spec; on the local spec with `local_spec_modules()` in every layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if use_te:
        return block
    modules = local_spec_modules()
    return dataclasses.replace(block, layer_specs=[_local_layer(spec, *modules) for spec in block.layer_specs])
