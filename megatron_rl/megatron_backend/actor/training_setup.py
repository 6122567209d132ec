"""What makes a built model trainable: Megatron DDP, the Megatron optimizer and the LR schedule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megatron_rl.config.options import ModelOptions, OptimizerOptions
from megatron_rl.megatron_backend import platform


def wrap_for_training(
    chunks: list[nn.Module], config: Any, model_options: ModelOptions, opt: OptimizerOptions
) -> tuple[list[nn.Module], Any, Any]:
    """`(DDP-wrapped chunks, optimizer, scheduler)`; sets the schedule hooks on the model's `config`.

    Per-token loss mode (`calculate_per_token_loss`): the schedule divides the gradients by the global token
    (or sequence) count the loss functions return, so a step minimises the exact global mean."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    bf16 = model_options.dtype == "bf16"
    check_optimizer_platform(opt)
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=opt.distributed_optimizer,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
    )
    wrapped = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=Float16Module(config, chunk) if bf16 else chunk,
            disable_bucketing=i > 0,
        )
        for i, chunk in enumerate(chunks)
    ]
    check_one_grad_norm_group(wrapped)
    optimizer = get_megatron_optimizer(OptimizerConfig(**optimizer_config_fields(opt, bf16)), wrapped)
    use_fastest_torch_adam(optimizer)
    count_expert_grads_by_expert_tp(optimizer, wrapped)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.warmup_steps,
        lr_decay_steps=max(opt.total_steps, opt.warmup_steps + 1),
        lr_decay_style=opt.lr_schedule,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=max(opt.total_steps, 1),
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped, optimizer, scheduler


def check_optimizer_platform(opt: OptimizerOptions) -> None:
    """Refuse, by config key, the optimizer features this machine cannot run (the config validation refuses the
    combinations no machine can run; this needs the platform).

    * precision_aware: Megatron-Core's `OptimizerConfig.__post_init__` reads Transformer Engine's version (0.16
      and 0.19 fail with a TypeError without it) and, without CPU offload, steps with its FusedAdam (CUDA).
    * cpu_offload: Megatron-Core's `HybridDeviceOptimizer` moves GPU parameters' optimizer state to the host; a
      parameter already on the host is taken for such a copy and its step fails (KeyError in
      `_set_sub_optimizer_grads`): there is nothing to offload on a CPU run."""
    if opt.precision_aware and not platform.transformer_engine_available():
        raise ValueError(
            "optimizer.precision_aware=true needs Transformer Engine (Megatron-Core's precision-aware optimizer "
            "is its FusedAdam, and the config reads its version), which is not available here: install it on a "
            "CUDA machine or set optimizer.precision_aware=false"
        )
    if opt.cpu_offload and platform.device().type != "cuda":
        raise ValueError(
            "optimizer.cpu_offload=true moves the optimizer state of GPU parameters to host memory; this run's "
            "parameters are on the CPU already (Megatron's HybridDeviceOptimizer cannot step them): set "
            "optimizer.cpu_offload=false"
        )


STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}
"""Config names of the precision-aware optimizer's dtypes; fp8 is `torch.uint8` (Transformer Engine's FusedAdam
stores fp8 moments as uint8 with a per-tensor scale, as Megatron's --exp-avg-dtype fp8 maps it)."""


def optimizer_config_fields(opt: OptimizerOptions, bf16: bool) -> dict[str, Any]:
    """The fields of Megatron-Core's `OptimizerConfig` (0.16 and 0.19 name them alike) for `opt`.

    CPU offload (`optimizer_cpu_offload`): the distributed optimizer hands its shards to Megatron's
    `HybridDeviceOptimizer`, which keeps `offload_fraction` of them in pinned host memory as fp32 main
    parameters with fp32 Adam moments, steps them with torch's AdamW on the CPU and copies the new parameters
    back (overlapped with the step, per parameter, when `overlap_offload_transfers`). With the precision-aware
    optimizer as well, the GPU holds no fp32 main copy at all (slime's recipe for Qwen3-30B-A3B on 8xH100).
    `store_param_remainders` (Transformer Engine's FusedAdam keeps 16 bits of each fp32 main parameter) is off
    then: the host optimizer keeps whole fp32 copies, and a resumed optimizer's empty state must say so.
    Megatron-Core's own `OptimizerConfig.__post_init__` refuses the combinations it cannot run; the config
    validation (`config/validation.py`) refuses them earlier, by config key."""
    offload = opt.cpu_offload
    fields: dict[str, Any] = dict(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=opt.distributed_optimizer,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=opt.offload_fraction if offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=offload and opt.overlap_offload_transfers,
        use_precision_aware_optimizer=opt.precision_aware,
    )
    if opt.precision_aware:
        moments = STATE_DTYPES[opt.moments_dtype]
        fields |= dict(
            main_params_dtype=STATE_DTYPES[opt.main_params_dtype], exp_avg_dtype=moments, exp_avg_sq_dtype=moments
        )
        if offload:
            fields["store_param_remainders"] = False
    return fields


def use_fastest_torch_adam(optimizer: Any) -> None:
    """Step the torch Adam/AdamW Megatron falls back to (no Transformer Engine or apex: CPU, a bare GPU install)
    with torch's fused kernel where every parameter's device and dtype have one (CPU and CUDA in torch 2.x),
    else its multi-tensor (foreach) kernel on CUDA. Megatron builds it with torch's default, the per-tensor
    loop on CPU. The state it keeps (`step`, `exp_avg`, `exp_avg_sq`) is the same, so checkpoints load either
    way; TE's and apex's FusedAdam are left as they are."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    fused_devices = set(_get_fused_kernels_supported_devices())
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        fused = all(p.device.type in fused_devices and p.is_floating_point() for p in params)
        choice = {"fused": fused, "foreach": not fused and all(p.device.type == "cuda" for p in params)}
        inner.defaults.update(choice)
        for group in inner.param_groups:
            group.update(choice)
        if fused:
            inner._step_supports_amp_scaling = True  # as torch's constructor sets it with fused=True


def check_one_grad_norm_group(chunks: list[nn.Module]) -> None:
    """Refuse parameters that megatron-core 0.19 clips by a norm of their own (`grad_norm_group`: its MTP
    layers): `clip_and_step` clips every gradient by the one global norm the non-finite check reads."""
    tagged = sorted({str(g) for c in chunks for p in c.parameters() if (g := getattr(p, "grad_norm_group", None))})
    if tagged:
        raise ValueError(
            f"parameters in a separate gradient-norm group ({', '.join(tagged)}: Megatron's multi-token-prediction "
            "layers) are not supported: the update clips every gradient by one global norm"
        )


def count_expert_grads_by_expert_tp(optimizer: Any, chunks: list[nn.Module]) -> None:
    """Give the experts' optimizer the expert tensor-parallel group to tell a replica from an original.

    Megatron-Core 0.16 hands every inner optimizer the dense TP group (`tp_group`), by which the gradient norm and
    the zero count skip a parameter not split over TP on TP ranks other than 0. Expert parameters are replicated
    over expert TP instead: with expert TP below TP, another dense-TP rank holds other experts (or the same ones
    as an expert-data-parallel replica), and an expert parameter not split over expert TP (a LoRA adapter's
    replicated factor, an expert bias) would drop out of the norm there. Megatron builds the experts' optimizer
    last, when any trained parameter is an expert's (`allreduce=False`)."""
    from megatron.core import parallel_state as ps

    if any(not getattr(p, "allreduce", True) for c in chunks for p in c.parameters() if p.requires_grad):
        list(inner_optimizers(optimizer))[-1].tp_group = ps.get_expert_tensor_parallel_group()


@torch.no_grad()
def grad_norm_before_step(optimizer: Any) -> tuple[bool, Any]:
    """Collective: `(overflow, norm)` of this update's gradients, the first half of Megatron's `step()`:
    `prepare_grads` (the main gradients from DDP's reduced buffers; `overflow` only from a loss scaler, fp16)
    and `get_grad_norm`, the global L2 norm over every layout (TP/EP/PP/DP; reduced over the optimizer's
    gradient-statistics group, so the same on every rank), NaN/inf when any gradient it covers is."""
    overflow = bool(optimizer.prepare_grads())
    return overflow, optimizer.get_grad_norm()


@torch.no_grad()
def clip_and_step(optimizer: Any, grad_norm: Any) -> bool:
    """The second half of Megatron's `step()` after `grad_norm_before_step`: every inner optimizer's gradients
    clipped by the global `grad_norm` (as `ChainedOptimizer.step` clips them, without computing it again), then
    Adam and the parameter gather. Returns Megatron's success flag."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in inner_optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, grad_norm, use_decoupled_grad=decoupled)
    return bool(optimizer.step_with_ready_grads())


def inner_optimizers(optimizer: Any) -> Iterator[Any]:
    """The Megatron optimizers behind `optimizer` (a chained optimizer holds one per parameter group kind)."""
    yield from getattr(optimizer, "chained_optimizers", [optimizer])


@torch.no_grad()
def zero_optimizer_state(optimizer: Any) -> None:
    """Zero Adam's moments and step count. The main parameters some optimizers keep in their state (the
    precision-aware FusedAdam's and the hybrid device optimizer's `master_param`) are weights, not moments: kept;
    FusedAdam counts steps per parameter group."""
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", opt)
        if inner is None:  # a rank without parameters in this optimizer
            continue
        for state in inner.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "master_param":
                    value.zero_()
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = 0


def reload_main_params(optimizer: Any) -> None:
    """After the model's weights changed outside the optimizer, copy them into its fp32 main parameters."""
    for opt in inner_optimizers(optimizer):
        if hasattr(opt, "reload_model_params"):
            opt.reload_model_params()


def resident_tensors(
    chunks: list[nn.Module], modules: list[nn.Module], optimizer: Any
) -> Iterator[torch.Tensor | None]:
    """Every tensor of model or optimizer state (some `None`). Views are yielded alongside their buffers
    (DDP's param/grad buffers, the distributed optimizer's shards): `StorageOffload` moves each storage once."""
    from megatron.core.distributed import DistributedDataParallel

    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel):
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                yield buffer.param_data  # None without the distributed optimizer
                yield buffer.grad_data
    for module in modules:
        for param in module.parameters():
            yield param
            yield param.grad
            yield getattr(param, "main_grad", None)
            yield getattr(param, "main_param", None)  # the distributed optimizer's fp32 shard
        yield from module.buffers()
    if optimizer is None:
        return
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", opt)
        if inner is None:  # a rank without parameters in this optimizer
            continue
        for group in inner.param_groups:  # fp32 main params (views of the model's when fp32)
            for param in group["params"]:
                yield param
                if param.is_leaf:  # a view's grad is a view of DDP's grad buffer (and reading it warns)
                    yield param.grad
        for state in inner.state.values():  # exp_avg, exp_avg_sq, ...
            yield from state.values()
