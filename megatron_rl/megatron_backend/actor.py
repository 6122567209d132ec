"""The Megatron actor: a TP/EP/PP-parallel MoE policy that scores tokens and trains on RL losses.

One object owns the model chunks, Megatron DDP, the Megatron optimizer and the LR schedule.
`compute_log_probs` and `train_step` run Megatron's own forward-backward schedules (no pipelining,
1F1B, interleaved) over micro-batches formed by a token budget. Log-probs and entropy are computed
from vocab-parallel logits without gathering the vocabulary.

Loss contract for `train_step`: `loss_fn(log_probs, entropy, micro_batch) -> (loss_sum, count, metrics)`,
where `loss_sum` is a sum over this micro-batch and `count` (an int tensor: tokens or sequences) is
its share of the normaliser. Megatron's per-token-loss mode then divides the gradients by the global
count summed over micro-batches and data-parallel ranks, so the step minimises the exact global mean.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.kernels import token_logprobs_and_entropy
from megatron_rl.megatron_backend import hf_weights, platform
from megatron_rl.megatron_backend.batch import TokenBatch, split_by_token_budget
from megatron_rl.megatron_backend.model_builder import build_model
from megatron_rl.megatron_backend.models.family import HFConfig, get_family
from megatron_rl.megatron_backend.offload import StorageOffload, TransferStats
from megatron_rl.megatron_backend.options import ModelOptions, OptimizerOptions
from megatron_rl.megatron_backend.parallel_layout import ParallelLayout
from megatron_rl.megatron_backend.routes import MoERouters

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor | None, TokenBatch], tuple[torch.Tensor, torch.Tensor, dict]]


class NonFiniteError(ValueError):
    """A training update's loss or gradient is NaN/inf; the update was not applied. A ValueError like the
    project's other input errors (the CLI prints its one line): the cause is an input of the run (learning
    rate, rewards, data), not the code."""


@dataclass
class ScoreResult:
    """Per-position outputs aligned with `input_ids` (position 0 and padding are 0)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # [batch, seq, moe_layers, top_k]; row t = routing of the token at t


class MegatronActor:
    """A Megatron-Core MoE policy on this rank's share of a parallel layout."""

    def __init__(
        self,
        hf_config: HFConfig,
        layout: ParallelLayout,
        model_options: ModelOptions | None = None,
        optimizer_options: OptimizerOptions | None = None,
        *,
        micro_batch_tokens: int = 4096,
    ):
        from megatron.core import parallel_state as ps

        self.hf_config = hf_config
        self.family = get_family(hf_config)
        self.dims = self.family.dims(hf_config)
        self.layout = layout
        self.model_options = model_options or ModelOptions()
        self.micro_batch_tokens = micro_batch_tokens
        self.chunks, self.config = build_model(hf_config, layout, self.model_options)
        self.routers = MoERouters(self.chunks)
        self.optimizer = None
        self.scheduler = None
        self.step = 0
        self.last_route_agreement = None  # RouteAgreement of the last replayed pass (routing.agreement)
        self._offload: StorageOffload | None = None  # set while the training state is parked on the host
        if optimizer_options is not None:
            self._setup_training(optimizer_options)
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_hf(cls, model_dir: str | Path, layout: ParallelLayout, **kwargs: Any) -> MegatronActor:
        hf = hf_weights.read_hf_config(model_dir)
        actor = cls(hf, layout, **kwargs)
        actor.load_hf(model_dir)
        return actor

    def load_hf(self, model_dir: str | Path) -> None:
        self._check_resident("load_hf")
        hf = hf_weights.read_hf_config(model_dir)
        check_architecture(self.hf_config, hf, model_dir)
        hf_weights.load_hf_weights(self.modules, model_dir, self.family, self.hf_config)
        if self.optimizer is not None:
            self._reload_main_params()

    def export_hf(self, *, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None):
        """HF-named full tensors in buckets (collective: every rank must consume the iterator)."""
        self._check_resident("export_hf")
        return hf_weights.export_hf_weights(
            self.modules, self.family, self.hf_config, bucket_bytes=bucket_bytes, dtype=dtype
        )

    @property
    def modules(self) -> list[nn.Module]:
        """The bare GPT models (unwrapped from DDP / Float16Module)."""
        return [hf_weights.unwrap_model(c) for c in self.chunks]

    # ------------------------------------------------------------------ training setup
    def _setup_training(self, opt: OptimizerOptions) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        bf16 = self.model_options.dtype == "bf16"
        self.config.calculate_per_token_loss = True
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=opt.distributed_optimizer,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
        )
        wrapped = []
        for i, chunk in enumerate(self.chunks):
            module = Float16Module(self.config, chunk) if bf16 else chunk
            wrapped.append(
                DistributedDataParallel(
                    config=self.config, ddp_config=ddp_config, module=module, disable_bucketing=i > 0
                )
            )
        self.chunks = wrapped
        self.optimizer = get_megatron_optimizer(
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
            self.chunks,
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
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
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync

    @torch.no_grad()
    def reset_optimizer_state(self) -> None:
        """Zero Adam's moments and step count (e.g. between a supervised warm-up and RL, so the warm-up's
        momentum does not keep moving the policy when RL gradients are zero)."""
        self._check_resident("reset_optimizer_state")
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for state in getattr(opt, "optimizer", opt).state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        value.zero_()

    def _reload_main_params(self) -> None:
        """After weights changed outside the optimizer, copy them into its fp32 main parameters."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "reload_model_params"):
                opt.reload_model_params()

    # ------------------------------------------------------------------ accelerator memory
    @property
    def offloaded(self) -> bool:
        """Whether `offload()` parked the training state on the host (until `reload()`)."""
        return self._offload is not None

    def offload(self) -> TransferStats:
        """Free this rank's accelerator memory for a colocated rollout engine: parameters, Megatron's
        parameter and gradient buffers, and the optimizer's main parameters and state move to host memory.

        Scoring, training and weight export refuse to run until `reload()`."""
        if self._offload is not None:
            raise RuntimeError("MegatronActor.offload(): the actor is already offloaded")
        offload = StorageOffload(self._resident_tensors())
        stats = offload.offload()
        self._offload = offload
        return stats

    def reload(self) -> TransferStats:
        """Bring back what `offload()` moved, bit for bit."""
        if self._offload is None:
            raise RuntimeError("MegatronActor.reload(): the actor is not offloaded")
        stats = self._offload.reload()
        self._offload = None
        return stats

    def _resident_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of model or optimizer state on this rank's accelerator. Views are yielded alongside
        their buffers (DDP's param/grad buffers, the distributed optimizer's shards): `StorageOffload` moves
        each storage once."""
        from megatron.core.distributed import DistributedDataParallel

        def tensors() -> Iterator[torch.Tensor | None]:
            for chunk in self.chunks:
                if isinstance(chunk, DistributedDataParallel):
                    for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                        yield buffer.param_data  # None without the distributed optimizer
                        yield buffer.grad_data
            for module in self.modules:
                for param in module.parameters():
                    yield param
                    yield param.grad
                    yield getattr(param, "main_grad", None)
                    yield getattr(param, "main_param", None)  # the distributed optimizer's fp32 shard
                yield from module.buffers()
            if self.optimizer is None:
                return
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
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

        device = platform.device().type
        for tensor in tensors():
            if torch.is_tensor(tensor) and tensor.device.type == device:
                yield tensor

    def _check_resident(self, what: str) -> None:
        if self._offload is not None:
            raise RuntimeError(f"MegatronActor.{what}(): the actor is offloaded; call reload() first")

    # ------------------------------------------------------------------ forward/backward
    def _micro_batches(self, batch: TokenBatch) -> list[TokenBatch]:
        """Micro-batches by token budget, as many on every data-parallel rank; under pipeline parallelism
        all get one fixed shape.

        Expert-parallel all-to-alls span data-parallel ranks, so every rank must run the same number of
        micro-batches (a rank with fewer samples gets dummy rows). Megatron's variable-shape p2p path
        exchanges shapes with batched send/recv, which mis-pairs messages when the previous and next stage
        are the same rank (PP=2); fixed shapes avoid it.
        """
        from megatron.core import parallel_state as ps

        multiple = self.layout.tp if self.layout.sequence_parallel else 1
        groups = split_by_token_budget(batch.lengths.tolist(), self.micro_batch_tokens)
        count = torch.tensor([len(groups)])
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._dp_group)
        groups = _regroup(groups, int(count))
        if self.layout.pp == 1:
            return [batch.select(g, pad_to_multiple=multiple, rows=max(len(g), 1)) for g in groups]
        seq, rows = int(batch.lengths.max()), max(max(len(g) for g in groups), 1)
        return [batch.select(g, pad_to_multiple=multiple, seq_len=seq, rows=rows) for g in groups]

    def _dp_shard(self, batch: TokenBatch) -> tuple[TokenBatch, list[int]]:
        from megatron.core import parallel_state as ps

        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        index = list(range(rank, batch.size, dp))
        if not index:
            raise ValueError(f"batch of {batch.size} samples is smaller than the data-parallel size {dp}")
        return batch.select(index), index

    def _run(
        self,
        micro_batches: list[TokenBatch],
        loss_func: Callable[[TokenBatch, torch.Tensor], tuple],
        *,
        forward_only: bool,
        record_routes: bool = False,
        replay_routes: bool = False,
    ) -> tuple[list, list[list[torch.Tensor]]]:
        """Run Megatron's schedule; with `record_routes` also return, per micro-batch, the recorded
        top-k indices of this rank's MoE layers (in `self.routers.handles` order).

        With `replay_routes`, every router call is checked to route as replayed, each micro-batch's routes
        must be consumed exactly once (`routing.replay.check_consumed`, else `RouteReplayError`), and the
        agreement of the replayed routes with the current weights' natural routes is left in
        `self.last_route_agreement`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_rl.megatron_backend.routes import ReplayMonitor
        from megatron_rl.routing.replay import check_consumed

        recorded: list[list[list[torch.Tensor]]] = [[] for _ in self.chunks]  # [chunk][micro-batch][layer]
        chunk_of = {id(c): i for i, c in enumerate(self.chunks)}
        monitor = ReplayMonitor(self.routers, self.dims.moe_layers, measure=True) if replay_routes else None
        self.last_route_agreement = None

        def forward_step(data_iterator: Iterator[TokenBatch], model: nn.Module):
            mb = next(data_iterator)
            ids = mb.input_ids.to(platform.device())
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
            chunk = chunk_of[id(model)]
            if replay_routes:
                valid = self._set_replay_targets(mb, chunk)
                monitor.begin_micro_batch(chunk, valid)
                self.routers.set_action("replay_forward", chunk=chunk)
            output = model(ids, pos, attention_mask=None)
            if replay_routes and not forward_only:
                # Activation recompute re-runs this forward during backward: it pops the same routes.
                self.routers.set_action("replay_backward", chunk=chunk)
            if record_routes:
                recorded[chunk_of[id(model)]].append(self.routers.take_recorded(chunk_of[id(model)]))
            return output, partial(loss_func, mb)

        if record_routes and replay_routes:
            raise ValueError("record_routes and replay_routes are exclusive")
        if record_routes:
            self.routers.set_action("record")
        if replay_routes:
            if any(mb.routes is None for mb in micro_batches):
                raise ValueError("replay_routes needs batch.routes")
        try:
            iterators = [iter(micro_batches) for _ in self.chunks]
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
                model=self.chunks,
                num_microbatches=len(micro_batches),
                seq_length=max(mb.input_ids.shape[1] for mb in micro_batches),
                micro_batch_size=max(mb.size for mb in micro_batches),
                forward_only=forward_only,
            )
        finally:
            uses = monitor.uses() if monitor is not None else []
            if monitor is not None:
                monitor.remove()
            if record_routes or replay_routes:
                self.routers.set_action(None)
                self.routers.clear()
        if monitor is not None:
            recompute = self.model_options.recompute == "full" and not forward_only
            check_consumed(uses, len(micro_batches), recompute=recompute)
            self.last_route_agreement = self._reduce_agreement(monitor, len(micro_batches))
        per_micro_batch = (
            [[t for chunk in range(len(self.chunks)) for t in recorded[chunk][m]] for m in range(len(micro_batches))]
            if record_routes
            else []
        )
        return outputs, per_micro_batch

    def _positions(self, mb: TokenBatch, below_length: int) -> torch.Tensor:
        """`[b, s]` bool: positions t < length + below_length of real (non-dummy) rows."""
        b, s = mb.input_ids.shape
        mask = torch.arange(s).unsqueeze(0) < (mb.lengths.unsqueeze(1) + below_length)
        if mb.padding_rows:
            mask[-mb.padding_rows :] = False
        return mask

    def _token_mask(self, mb: TokenBatch, *, real_routes: bool) -> torch.Tensor:
        """This rank's tokens of `mb` in Megatron's order (`[s_local * b]`, s-major, SP slice): with
        `real_routes` those with a route that matters (t < length - 1), else every real token (t < length)."""
        from megatron.core import parallel_state as ps

        mask = self._positions(mb, -1 if real_routes else 0)
        if self.layout.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            mask = mask.chunk(ps.get_tensor_model_parallel_world_size(), dim=1)[ps.get_tensor_model_parallel_rank()]
        return mask.transpose(0, 1).reshape(-1)

    def _set_replay_targets(self, mb: TokenBatch, chunk: int) -> torch.Tensor:
        """Hand each router of `chunk` the experts to use for this micro-batch, in Megatron's token order;
        return which of those tokens carry real routes (`[s_local * b]` bool, same order).

        Megatron flattens hidden states `[s, b]` s-major; with sequence parallelism each tensor-parallel
        rank holds a contiguous slice of the sequence. Real routes: positions t < length - 1 of real rows
        (the last token has no route in SGLang's layout and feeds no log-prob). Rows with a repeated
        expert (recorded padding reads 0) get experts 0..k-1: what a recording routes padding to, so a
        replayed re-run of the recorded micro-batches is bitwise identical to the recording.
        """
        from megatron.core import parallel_state as ps

        routes = mb.routes  # [b, s, moe_layers, k]
        b, s, _, k = routes.shape
        valid = self._positions(mb, below_length=-1)
        sorted_routes = routes.sort(-1).values
        repeated = (sorted_routes[..., 1:] == sorted_routes[..., :-1]).any(-1, keepdim=True)
        routes = torch.where(repeated, torch.arange(k, dtype=routes.dtype), routes)
        if self.layout.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            routes = routes.chunk(tp, dim=1)[rank]
            valid = valid.chunk(tp, dim=1)[rank]
        moe_layers = self.dims.moe_layers
        layers_of_chunk = {layer.layer_number - 1 for layer in self.modules[chunk].decoder.layers}
        for handle in self.routers.handles:
            if handle.global_layer not in layers_of_chunk:
                continue
            column = moe_layers.index(handle.global_layer)
            target = routes[:, :, column].transpose(0, 1).reshape(-1, routes.shape[-1]).long().to(platform.device())
            handle.router.router_replay.set_target_indices(target)
        return valid.transpose(0, 1).reshape(-1)

    def _reduce_agreement(self, monitor, micro_batches: int):
        """Replayed-vs-natural route agreement over the whole step (all layers, stages and ranks)."""
        from megatron.core import parallel_state as ps

        from megatron_rl.routing.agreement import AgreementCounts

        chunks = sorted(monitor.disagree)
        disagree = torch.cat([sum(monitor.disagree[c][m] for c in chunks) for m in range(micro_batches)])
        valid = torch.cat([monitor.valid_of[chunks[0]][m] for m in range(micro_batches)])
        per_layer = torch.cat([monitor.counts.matches, monitor.counts.slots])
        if ps.get_pipeline_model_parallel_world_size() > 1:  # same tokens, other layers on each stage
            dist.all_reduce(disagree, group=self._pp_group)
            dist.all_reduce(per_layer, group=self._pp_group)
        tokens = torch.tensor([float(((disagree == 0) & valid).sum()), float(valid.sum())], dtype=torch.float64)
        vec = torch.cat([per_layer, tokens])
        dist.all_reduce(vec, group=self._dp_group)  # other samples
        if self.layout.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(vec, group=self._tp_group)  # other sequence slices
        return AgreementCounts.from_tensor(vec).result()

    def _token_stats(self, mb: TokenBatch, logits: torch.Tensor, with_entropy: bool, temperature: float):
        """log p(ids[t] | ids[:t]) and entropy at positions 1..s-1 from vocab-parallel logits [b, s, V/tp]."""
        ids = mb.input_ids.to(logits.device)
        logp, ent = token_logprobs_and_entropy(
            logits[:, :-1],
            ids[:, 1:],
            tp_group=self._tp_group,
            valid_vocab_size=self.dims.vocab_size,
            temperature=temperature,
            with_entropy=with_entropy,
            impl=self.model_options.logprob_impl,
        )
        logp = torch.nn.functional.pad(logp, (1, 0))
        ent = None if ent is None else torch.nn.functional.pad(ent, (1, 0))
        return logp, ent

    @torch.no_grad()
    def compute_log_probs(
        self,
        batch: TokenBatch,
        *,
        with_entropy: bool = False,
        record_routes: bool = False,
        replay_routes: bool = False,
        temperature: float = 1.0,
    ) -> ScoreResult:
        """Per-token log-probs (and entropy, routes) for the whole batch, identical on every rank."""
        self._check_resident("compute_log_probs")
        for chunk in self.chunks:
            chunk.eval()
        shard, index = self._dp_shard(batch)
        micro_batches = self._micro_batches(shard)
        results: list[tuple[torch.Tensor, torch.Tensor | None]] = []

        def loss_func(mb: TokenBatch, logits: torch.Tensor):
            logp, ent = self._token_stats(mb, logits.float(), with_entropy, temperature)
            real = mb.size - mb.padding_rows
            results.append((logp[:real].cpu(), None if ent is None else ent[:real].cpu()))
            return torch.zeros((), device=logits.device), torch.zeros((), dtype=torch.int), {}

        _, recorded = self._run(
            micro_batches, loss_func, forward_only=True, record_routes=record_routes, replay_routes=replay_routes
        )
        s = batch.input_ids.shape[1]
        logp = torch.zeros(shard.size, s)
        ent = torch.zeros(shard.size, s) if with_entropy else None
        if _is_last_stage():
            row = 0
            for lp, en in results:
                n, w = lp.shape
                w = min(w, s)
                logp[row : row + n, :w] = lp[:, :w]
                if ent is not None:
                    ent[row : row + n, :w] = en[:, :w]
                row += n
        logp = _broadcast_from_last_stage(logp, self._pp_group)
        if ent is not None:
            ent = _broadcast_from_last_stage(ent, self._pp_group)
        routes = self._assemble_routes(micro_batches, recorded, s) if record_routes else None
        # Padding positions keep the routes they were actually given: replaying them reproduces the
        # recorded pass bitwise (expert GEMMs are not independent of the other tokens in the batch).
        valid = _positions_below(shard.lengths, s)
        logp = torch.where(valid, logp, 0.0)
        ent = None if ent is None else torch.where(valid, ent, 0.0)
        return _gather_dp(ScoreResult(logp, ent, routes), index, batch.size, self._dp_group)

    def _assemble_routes(self, micro_batches: list[TokenBatch], recorded: list[list[torch.Tensor]], s: int):
        """[shard_batch, s, moe_layers, top_k] from per-micro-batch, per-local-layer [s_local*b, k] records."""
        from megatron.core import parallel_state as ps

        k = self.dims.top_k
        dtype = torch.uint8 if self.dims.num_experts <= 256 else torch.int16
        per_mb = []
        for mb, layers in zip(micro_batches, recorded, strict=True):
            b, s_mb = mb.input_ids.shape
            stacked = torch.stack([t.view(-1, b, k) for t in layers], dim=2) if layers else torch.empty(0)
            if self.layout.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1 and layers:
                parts = [torch.empty_like(stacked) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(parts, stacked.contiguous(), group=self._tp_group)
                stacked = torch.cat(parts, dim=0)
            per_mb.append(stacked.permute(1, 0, 2, 3).to(dtype).cpu() if layers else None)  # [b, s_mb, L_local, k]
        # Collect the layers of every pipeline stage.
        local = (self.routers.layers, per_mb)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(gathered, local, group=self._pp_group)
        else:
            gathered = [local]
        order = sorted(
            (layer, stage, j) for stage, (layers, _) in enumerate(gathered) for j, layer in enumerate(layers)
        )
        total = sum(mb.size - mb.padding_rows for mb in micro_batches)
        out = torch.zeros(total, s, len(order), k, dtype=dtype)
        row = 0
        for m, mb in enumerate(micro_batches):
            n, w = mb.size - mb.padding_rows, min(mb.input_ids.shape[1], s)
            for col, (_, stage, j) in enumerate(order):
                out[row : row + n, :w, col] = gathered[stage][1][m][:n, :w, j]
            row += n
        return out

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        replay_routes: bool = False,
        lr: float | None = None,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        where: str = "this update",
    ) -> dict[str, float]:
        """One optimizer step over `batch` (this call's global batch); returns averaged metrics.

        `replay_routes`: force `batch.routes` in the forward and in the activation-recompute forward; the
        metrics then include `routing/agreement`, `routing/token_all_layers_agree` and
        `routing/layer_<i>_agreement` (replayed vs natural routes of the weights before this step).
        `lr`: use this learning rate for this step and leave the LR schedule where it is (warm-up stages).
        A NaN/inf loss in any micro-batch or gradient, on any rank, stops the update before the optimizer
        touches the weights: `on_nonfinite="stop"` raises `NonFiniteError` (naming `where` and the micro-batch);
        "skip" drops the gradients, leaves the optimizer, schedule and `self.step` alone and returns the metrics
        with `nonfinite_skipped` = 1.
        """
        self._check_resident("train_step")
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        shard, _ = self._dp_shard(batch)
        micro_batches = self._micro_batches(shard)

        def loss_func(mb: TokenBatch, logits: torch.Tensor):
            logp, ent = self._token_stats(mb, logits, with_entropy, 1.0)
            loss_sum, count, metrics = loss_fn(logp, ent, mb)
            count = count.to(torch.int).reshape(())
            metrics = {k: float(v) for k, v in metrics.items()}
            metrics["_count"] = int(count)
            return loss_sum, count, {"loss_sum": loss_sum.detach().float(), "metrics": metrics}

        outputs, _ = self._run(micro_batches, loss_func, forward_only=False, replay_routes=replay_routes)
        agreement = self.last_route_agreement
        problem = self._find_nonfinite(outputs, len(micro_batches), where)
        if problem is not None:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            if on_nonfinite == "stop":
                raise NonFiniteError(
                    f"{problem}; the update was not applied (lower optimizer.lr or check the rewards; "
                    "trainer.on_nonfinite=skip skips such updates)"
                )
            if dist.get_rank() == 0:
                logger.warning("%s; update skipped (trainer.on_nonfinite=skip)", problem)
            return {**self._reduce_metrics(outputs, None), "nonfinite_skipped": 1.0}
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # only with a loss scaler (fp16), which found an overflow the check above did not
            raise NonFiniteError(f"gradient overflow at {where}: the optimizer skipped the update")
        if lr is None:
            self.scheduler.step(increment=1)
            self.step += 1
        else:
            self.scheduler.step(increment=0)  # put the schedule's LR back
        metrics = self._reduce_metrics(outputs, grad_norm)
        if lr is not None:
            metrics["lr"] = lr
        if agreement is not None:  # replayed routes vs the routes these (pre-update) weights would choose
            metrics.update(agreement.as_metrics("routing/", self.dims.moe_layers))
        return metrics

    def _find_nonfinite(self, outputs: list, count: int, where: str) -> str | None:
        """Collective: why this update must not be applied (a NaN/inf micro-batch loss or gradient on any
        rank), else None. The gradient check reads DDP's reduced grad buckets, before the optimizer clips
        them (clipping by a NaN norm would spread the NaN to every weight)."""
        bad_micro_batch, detail = 0, ""
        for i, out in enumerate(outputs if _is_last_stage() else [], start=1):
            loss = float(out["loss_sum"])
            if not math.isfinite(loss):
                values = {"loss_sum": loss, **{k: v for k, v in out["metrics"].items() if k != "_count"}}
                detail = ", ".join(f"{k}={v:g}" for k, v in values.items() if not math.isfinite(v))
                bad_micro_batch = i
                break
        bad_grads = torch.zeros((), device=platform.device())
        for chunk in self.chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                for bucket in buffer.buckets:  # bucket by bucket: the bool temporary stays small
                    bad_grads = bad_grads.logical_or(~torch.isfinite(bucket.grad_data).all())
        flags = torch.stack([torch.tensor(float(bad_micro_batch), device=bad_grads.device), bad_grads.float()])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        micro_batch, grads = int(flags[0]), bool(flags[1])
        if micro_batch:
            values = f" ({detail})" if micro_batch == bad_micro_batch else " (on another rank)"
            return f"non-finite loss at {where}, micro-batch {micro_batch} of {count}{values}"
        if grads:
            return f"non-finite gradient at {where} (every micro-batch loss is finite)"
        return None

    def _reduce_metrics(self, outputs: list, grad_norm: float | None) -> dict[str, float]:
        """Count-weighted means of the loss and the loss_fn's metrics over micro-batches and DP ranks."""
        from megatron.core import parallel_state as ps

        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for out in outputs if _is_last_stage() else []:
            m = out["metrics"]
            sums["loss"] += float(out["loss_sum"])
            sums["count"] += m["_count"]
            for key, value in m.items():
                if key != "_count":
                    sums[key] = sums.get(key, 0.0) + value * m["_count"]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            box = [sums]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=self._pp_group)
            sums = box[0]
        names = sorted(sums)
        vec = torch.tensor([sums[n] for n in names], dtype=torch.float64)
        dist.all_reduce(vec, group=self._dp_group)
        totals = dict(zip(names, vec.tolist(), strict=True))
        count = max(totals["count"], 1.0)
        metrics = {n: v / count for n, v in totals.items() if n != "count"}
        metrics["count"] = totals["count"]
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics


def check_architecture(expected: HFConfig, got: HFConfig, where: str | Path) -> None:
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "intermediate_size",
        "tie_word_embeddings",
        "norm_topk_prob",
    )
    for key in keys:
        if expected.get(key) != got.get(key):
            raise hf_weights.WeightMismatchError(
                f"{where}: holds a model with {key}={got.get(key)!r} but the model was built with "
                f"{key}={expected.get(key)!r}: it is a checkpoint of another architecture"
            )


def _regroup(groups: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest groups until there are `count` (empty groups, padded with a dummy row, when
    there are fewer samples than micro-batches)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) <= 1:
            groups.append([])
            continue
        half = len(groups[largest]) // 2
        groups[largest : largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return groups


def _is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def _broadcast_from_last_stage(tensor: torch.Tensor, pp_group) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    src = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast(tensor, src=src, group=pp_group)
    return tensor


def _positions_below(lengths: torch.Tensor, s: int) -> torch.Tensor:
    """Non-padding positions t in [1, length) (every token with a preceding context)."""
    pos = torch.arange(s).unsqueeze(0)
    return (pos >= 1) & (pos < lengths.unsqueeze(1))


def _gather_dp(result: ScoreResult, index: list[int], total: int, dp_group) -> ScoreResult:
    """Reassemble the full batch from the data-parallel shards (rank r holds rows r, r+dp, ...)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return result
    parts: list = [None] * dp
    dist.all_gather_object(parts, (index, result), group=dp_group)

    def merge(attr: str):
        first = getattr(parts[0][1], attr)
        if first is None:
            return None
        out = torch.zeros((total, *first.shape[1:]), dtype=first.dtype)
        for idx, res in parts:
            out[torch.tensor(idx)] = getattr(res, attr)
        return out

    return ScoreResult(merge("log_probs"), merge("entropy"), merge("routes"))
