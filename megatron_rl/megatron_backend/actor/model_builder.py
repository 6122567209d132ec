"""Build a Megatron-Core GPT/MoE model (one chunk per virtual pipeline stage) from an HF config.

The Transformer Engine layer spec is used when TE imports and the platform is CUDA; the local
(pure Megatron-Core) spec otherwise. Everything that differs between the two lives here and in
the `platform` package.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_rl.config.options import ModelOptions
from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.layers import block_spec
from megatron_rl.megatron_backend.layers.grouped_experts import grouped_unsupported_reason, with_grouped_experts
from megatron_rl.megatron_backend.layers.packed_attention import packed_variant, with_local_core_attention
from megatron_rl.megatron_backend.layers.packed_rope import use_one_pass_thd_rope
from megatron_rl.megatron_backend.layers.sdpa_attention import sdpa_variant
from megatron_rl.models.family import HFConfig, ModelFamily, get_family
from megatron_rl.routing.compat import refuse_unsafe_replay_options

if TYPE_CHECKING:
    from megatron_rl.parallel_layout import ParallelLayout

VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron-LM's convention: pad the vocabulary to a multiple of 128 * TP; padding logits are masked."""
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def use_transformer_engine(options: ModelOptions) -> bool:
    if options.layer_spec == "local":
        return False

    te_ok = platform.device().type == "cuda" and platform.transformer_engine_available()
    if options.layer_spec == "te" and not te_ok:
        from megatron_rl.optional_deps import require

        require("transformer_engine.pytorch")
        raise RuntimeError("layer_spec='te' needs a CUDA device; use layer_spec='local' on CPU")
    return te_ok


def use_grouped_experts(config: object, options: ModelOptions, te: bool) -> bool:
    """Whether the local spec's MoE experts compute all at once per projection
    (`megatron_backend/layers/grouped_experts.py`) instead
    of in Megatron's per-expert module loop: `model.options.experts`, where "auto" groups whenever the config allows
    it (the same outputs and gradients, bitwise on SwiGLU experts; 2x faster at the demo's size, 5% at hidden 1024 /
    64 experts: benchmarks/bench_grouped_experts.py). With Transformer Engine the TE spec's experts are kept."""
    if options.experts == "sequential" or not getattr(config, "num_moe_experts", None):
        return False
    if te:
        if options.experts == "grouped":
            raise ValueError(
                "model.options.experts=grouped groups the local spec's experts; with the Transformer Engine spec "
                "(model.options.layer_spec) use model.options.experts=auto"
            )
        return False
    reason = grouped_unsupported_reason(config)
    if reason is not None and options.experts == "grouped":
        raise ValueError(
            f"model.options.experts=grouped is not supported with {reason}; use model.options.experts=sequential "
            "or auto"
        )
    return reason is None


def transformer_config(hf: HFConfig, layout: ParallelLayout, options: ModelOptions):
    """The Megatron `TransformerConfig` for this architecture, layout and options."""
    from megatron.core.transformer import TransformerConfig

    family = get_family(hf)
    kwargs = family.transformer_config_kwargs(hf)
    kwargs.update(layout.to_model_parallel_config_kwargs())
    bf16 = options.dtype == "bf16"
    kwargs.update(
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # On CPU every weight is made on the host anyway; on GPU initialise directly on the device.
        use_cpu_initialization=platform.device().type == "cpu",
        moe_token_dispatcher_type=options.dispatcher,
        moe_aux_loss_coeff=options.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if options.aux_loss_coeff > 0 else "none",
        moe_enable_routing_replay=options.routing_replay,
        # Router fusion (TE) silently bypasses RouterReplay; we never enable it.
        moe_router_fusion=False,
    )
    expert_tp = layout.etp if layout.etp is not None else layout.tp
    if kwargs.get("add_bias_linear") and kwargs.get("num_moe_experts") and expert_tp > 1:
        raise ValueError(
            f"this {family.model_type} model's experts have biases, which Megatron-Core supports only without "
            f"tensor parallelism inside an expert, but the layout has expert TP {expert_tp} (parallel.etp defaults "
            "to parallel.tp): set parallel.etp=1 (experts are then split by parallel.ep instead)"
        )
    if kwargs.get("moe_router_enable_expert_bias"):
        kwargs.update(moe_router_bias_update_rate=options.expert_bias_update_rate)
    elif options.expert_bias_update_rate:
        raise ValueError(
            f"model.options.expert_bias_update_rate={options.expert_bias_update_rate}: this {family.model_type} "
            "model's routers have no expert bias (only sigmoid routers with a score-correction bias do); set it to 0"
        )
    if options.recompute != "none":
        kwargs.update(recompute_granularity=options.recompute)
        if options.recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    if family.config_class == "mla":
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config = MLATransformerConfig(**kwargs)
    else:
        config = TransformerConfig(**kwargs)
    for name, value in (family.config_attributes(hf) if family.config_attributes else {}).items():
        setattr(config, name, value)  # read by GPTModel, not declared by the config class (YaRN's yarn_*)
    refuse_unsafe_replay_options(config)
    return config


def build_model(
    hf: HFConfig, layout: ParallelLayout, options: ModelOptions, *, meta: bool = False
) -> tuple[list[nn.Module], object]:
    """Model chunks for this rank (one per virtual pipeline stage) and their TransformerConfig.

    Requires `megatron.core.parallel_state` to be initialised with the same layout. `meta=True` builds the
    parameters on the meta device (shapes and checkpoint structure only, no memory), for the converters.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    family: ModelFamily = get_family(hf)
    config = transformer_config(hf, layout, options)
    if options.packing:
        use_one_pass_thd_rope()
    te = use_transformer_engine(options)
    grouped = use_grouped_experts(config, options, te)
    model_parallel_cuda_manual_seed(options.seed)
    vocab = padded_vocab_size(family.dims(hf).vocab_size, layout.tp)
    chunks: list[nn.Module] = []
    vpp = layout.vpp or 1
    for stage in range(vpp):
        vp_stage = stage if layout.vpp else None
        if family.layer_spec is not None:
            spec = block_spec(family.layer_spec)(config, te, vp_stage)
        else:
            spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage
            )
        if grouped:
            spec = with_grouped_experts(spec)
        if options.local_attention == "sdpa" and not te:
            spec = with_local_core_attention(spec, sdpa_variant)  # one fused kernel (TE's attention is fused)
        if options.packing and not te:
            spec = with_local_core_attention(spec, packed_variant)  # THD (TE's attention takes it natively)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=vocab,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                parallel_output=True,
                vp_stage=vp_stage,
                **family.gpt_model_kwargs(hf),
            )
        chunks.append(model if meta else model.to(platform.device()))
    return chunks, config
