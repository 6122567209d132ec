"""What makes a built model trainable: Megatron DDP, the Megatron optimizer and the LR schedule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megatron_rl.megatron_backend.options import ModelOptions, OptimizerOptions


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
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
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
        ),
        wrapped,
    )
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


def inner_optimizers(optimizer: Any) -> Iterator[Any]:
    """The Megatron optimizers behind `optimizer` (a chained optimizer holds one per parameter group kind)."""
    yield from getattr(optimizer, "chained_optimizers", [optimizer])


@torch.no_grad()
def zero_optimizer_state(optimizer: Any) -> None:
    """Zero Adam's moments and step count."""
    for opt in inner_optimizers(optimizer):
        for state in getattr(opt, "optimizer", opt).state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()


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
