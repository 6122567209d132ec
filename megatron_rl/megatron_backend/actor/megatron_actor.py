"""The Megatron actor: a TP/EP/PP-parallel MoE policy that scores tokens and trains on RL losses.

One object owns the model chunks, Megatron DDP, the Megatron optimizer and the LR schedule
(`training_setup.py`). `compute_log_probs`, `train_step` and `warmup_step` run Megatron's own
forward-backward schedules (no pipelining, 1F1B, interleaved) over this rank's micro-batches
(`micro_batches.py`), recording or replaying routes on request (`route_pass.py`). Log-probs and entropy
are computed from vocab-parallel logits without gathering the vocabulary.

Loss contract (`batch.LossFn`): `loss_fn(log_probs, entropy, micro_batch) -> (loss_sum, count, metrics)`
(plus `topk_log_probs=`, the policy's log-probs at the micro-batch's `teacher_topk_ids`, when it has them),
where `loss_sum` is a sum over this micro-batch and `count` (an int tensor: tokens or sequences) is its share
of the normaliser. Megatron's per-token-loss mode then divides the gradients by the global count summed
over micro-batches and data-parallel ranks, so the step minimises the exact global mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from megatron_rl.config.options import LoRAOptions, ModelOptions, OptimizerOptions
from megatron_rl.kernels import next_token_logprobs_and_entropy
from megatron_rl.kernels.topk_logprob import next_token_logprobs_at, next_token_topk
from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor import training_setup
from megatron_rl.megatron_backend.actor.batch import LossFn, TokenBatch
from megatron_rl.megatron_backend.actor.micro_batches import (
    RankPlan,
    gather_rows,
    model_inputs,
    plan_micro_batches,
    positions_below,
    schedule_shape,
    stack_rows,
)
from megatron_rl.megatron_backend.actor.model_builder import build_model
from megatron_rl.megatron_backend.actor.offload import StorageOffload, TransferStats
from megatron_rl.megatron_backend.actor.route_pass import RouteMode, RoutePass
from megatron_rl.megatron_backend.actor.routes import MoERouters
from megatron_rl.megatron_backend.actor.update_metrics import (
    NonFiniteError,
    drop_gradients,
    drop_nonfinite_update,
    grad_norm_too_large,
    mean_metrics,
    nonfinite_problem,
    reduce_metric_sums,
)
from megatron_rl.megatron_backend.lora.adapters import install_lora
from megatron_rl.megatron_backend.lora.peft_format import load_peft_adapter
from megatron_rl.megatron_backend.weights import hf_weights
from megatron_rl.models.architecture import check_same_architecture
from megatron_rl.models.family import HFConfig, get_family
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.parallel_layout import ParallelLayout
from megatron_rl.routing.agreement import RouteAgreement
from megatron_rl.routing.replay import FULL_CHECKS, ReplayChecks


@dataclass
class ScoreResult:
    """Per-position outputs aligned with `input_ids` (position 0 and padding are 0)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # recorded: [batch, seq, moe_layers, top_k]; row t = the token at t
    topk_ids: torch.Tensor | None = None  # compute_log_probs(top_k=k): [batch, seq, k], most likely first
    topk_log_probs: torch.Tensor | None = None  # their log-probs
    agreement: RouteAgreement | None = None  # replayed: the routes vs those the current weights would choose


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
        balance_quadratic: float = 0.0,
        lora: LoRAOptions | None = None,
    ):
        from megatron.core import parallel_state as ps

        self.hf_config = hf_config
        self.family = get_family(hf_config)
        self.dims = self.family.dims(hf_config)
        self.layout = layout
        self.model_options = model_options or ModelOptions()
        self.lora = lora if lora is not None and lora.rank > 0 else None
        if self.lora is not None and self.model_options.layer_spec == "auto":  # adapters wrap the local spec's layers
            self.model_options = dataclasses.replace(self.model_options, layer_spec="local")
        self.micro_batch_tokens = micro_batch_tokens
        self.balance_quadratic = balance_quadratic  # a sample's cost when balancing: tokens + this * tokens^2
        self.chunks: list[Any]  # the model chunks (one per virtual pipeline stage), DDP-wrapped for training
        self.chunks, self.config = self._build_chunks(hf_config, layout)
        self.routers = MoERouters(self.chunks)
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.step = 0
        self._offload: StorageOffload | None = None  # set while the training state is parked on the host
        if optimizer_options is not None:
            self.chunks, self.optimizer, self.scheduler = training_setup.wrap_for_training(
                self.chunks, self.config, self.model_options, optimizer_options
            )
        self._groups = {
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(),
        }

    def _build_chunks(self, hf_config: HFConfig, layout: ParallelLayout) -> tuple[list[Any], Any]:
        """The bare model chunks and their config (under LoRA with adapters: DDP and the optimizer take only them)."""
        chunks, config = build_model(hf_config, layout, self.model_options)
        if self.lora is not None:
            weights = self.family.weight_map(hf_config)
            install_lora(
                chunks, self.lora, weights,
                lambda c, name: hf_weights.global_name(chunks[c], name, weights.num_experts), hf_weights.tp_shard,
            )  # fmt: skip
        return chunks, config

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_hf(
        cls, model_dir: str | Path, layout: ParallelLayout, *, hf: HFConfig | None = None, **kwargs: Any
    ) -> MegatronActor:
        """The actor of the model in `model_dir`, its weights loaded (with `lora.init_from`, its adapters from that
        peft adapter); `hf`: its config.json when already read."""
        hf = hf if hf is not None else read_hf_config(model_dir)
        actor = cls(hf, layout, **kwargs)
        actor.load_hf(model_dir, hf=hf)
        if actor.lora is not None and actor.lora.init_from:  # continue from a peft adapter (else B = 0)
            load_peft_adapter(actor.chunks, actor.lora, actor.family.weight_map(hf).num_experts, actor.lora.init_from)
            if actor.optimizer is not None:
                actor.reload_main_params()
        return actor

    def load_hf(self, model_dir: str | Path, *, hf: HFConfig | None = None) -> None:
        """Load `model_dir`'s weights (its config.json, `hf` when already read, must be this actor's)."""
        self._check_resident("load_hf")
        hf = hf if hf is not None else read_hf_config(model_dir)
        check_same_architecture(self.hf_config, hf, model_dir)
        hf_weights.load_hf_weights(self.modules, model_dir, self.family, self.hf_config)
        if self.optimizer is not None:
            self.reload_main_params()

    def export_hf(self, *, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None, only: Any = None):
        """HF-named full tensors in buckets (collective: every rank must consume the iterator); `only`: names or all."""
        self._check_resident("export_hf")
        return hf_weights.export_hf_weights(
            self.modules, self.family, self.hf_config, bucket_bytes=bucket_bytes, dtype=dtype, only=only
        )

    @property
    def modules(self) -> list[nn.Module]:
        """The bare GPT models (unwrapped from DDP / Float16Module)."""
        return [hf_weights.unwrap_model(c) for c in self.chunks]

    # ------------------------------------------------------------------ optimizer state
    def reset_optimizer_state(self) -> None:
        """Zero Adam's moments and step count (e.g. between a supervised warm-up and RL, so the warm-up's
        momentum does not keep moving the policy when RL gradients are zero)."""
        self._check_resident("reset_optimizer_state")
        training_setup.zero_optimizer_state(self.optimizer)

    def reload_main_params(self) -> None:  # after weights changed outside the optimizer: into its fp32 main params
        training_setup.reload_main_params(self.optimizer)

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
        device = platform.device().type
        tensors = training_setup.resident_tensors(self.chunks, self.modules, self.optimizer)
        offload = StorageOffload(t for t in tensors if torch.is_tensor(t) and t.device.type == device)
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

    def _set_training(self, mode: bool) -> None:
        """Train or eval mode for every chunk; `Module.train` walks every submodule, so only on a change."""
        for chunk in self.chunks:
            if chunk.training != mode:
                chunk.train(mode)

    def _check_resident(self, what: str) -> None:
        if self._offload is not None:
            raise RuntimeError(f"MegatronActor.{what}(): the actor is offloaded; call reload() first")

    # ------------------------------------------------------------------ forward/backward
    def _run(
        self,
        batches: list[TokenBatch],
        loss_func: Callable[[TokenBatch, torch.Tensor], tuple],
        *,
        forward_only: bool,
        route_mode: RouteMode = None,
        replay: ReplayChecks = FULL_CHECKS,
        seq_len: int = 0,
    ) -> tuple[list, torch.Tensor | None, RouteAgreement | None]:
        """Run Megatron's schedule over `batches`: `(outputs, recorded routes, replay agreement)`.

        `route_mode="record"`: also return the routes of every MoE layer (`[rows, seq_len, moe_layers, top_k]`).
        `"replay"`: force `mb.routes`; every router call is checked to route as replayed, each micro-batch's
        routes must be consumed exactly once (else `RouteReplayError`), and the agreement of the replayed
        routes with the current weights' natural routes is returned."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunk_of = {id(c): i for i, c in enumerate(self.chunks)}
        routes = RoutePass(
            route_mode, self.routers, self.modules, self.dims, self.layout, micro_batches=batches,
            groups=self._groups, checks=replay,
        )  # fmt: skip

        def forward_step(data_iterator: Iterator[TokenBatch], model: nn.Module):
            mb = next(data_iterator)
            chunk = chunk_of[id(model)]
            routes.before_forward(mb, chunk)
            output = model(**model_inputs(mb))
            routes.after_forward(chunk, forward_only=forward_only)
            return output, partial(loss_func, mb)

        seq_length, micro_batch_size = schedule_shape(batches)
        try:
            iterators = [iter(batches) for _ in self.chunks]
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
                model=self.chunks,
                num_microbatches=len(batches),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )
        finally:
            uses = routes.close()
        recompute = self.model_options.recompute == "full" and not forward_only
        recorded, agreement = routes.finish(uses, recompute=recompute, seq_len=seq_len)
        return outputs, recorded, agreement

    def _plan(self, batch: TokenBatch) -> RankPlan:
        packing, quadratic = self.model_options.packing, self.balance_quadratic
        return plan_micro_batches(batch, self.micro_batch_tokens, self.layout, self._groups["dp"], packing=packing,
                                  quadratic=quadratic)  # fmt: skip

    def _token_stats(self, mb: TokenBatch, logits: torch.Tensor, with_entropy: bool, temperature: float):
        """Log-probs and entropy aligned with `mb.input_ids`, from vocab-parallel logits `[b, s, V/tp]`."""
        logp, ent = self._packed_stats(mb, logits, with_entropy, temperature)
        return mb.per_sample(logp), mb.per_sample(ent)

    def _packed_stats(self, mb: TokenBatch, logits: torch.Tensor, with_entropy: bool, temperature: float):
        """`_token_stats` as the model saw the tokens (the packed row when `mb` is packed: a sample's first position,
        which reads the previous sample's last logits, has no context and is never used)."""
        return next_token_logprobs_and_entropy(
            logits, mb.model_tokens(), tp_group=self._groups["tp"], valid_vocab_size=self.dims.vocab_size,
            temperature=temperature, with_entropy=with_entropy, impl=self.model_options.logprob_impl,
        )  # fmt: skip

    def _student_topk(self, mb: TokenBatch, logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor | None:
        """Top-k distillation: the policy's log-probs `[b, s, k]` at the teacher's top-k ids of `mb` (field
        `teacher_topk_ids`), differentiable; None when `mb` has none."""
        ids = mb.fields.get("teacher_topk_ids")
        if ids is None:
            return None
        packed = ids if mb.packing is None else mb.packing.pack(ids)
        return mb.per_sample(next_token_logprobs_at(
            logits, mb.model_tokens(), logp, packed, tp_group=self._groups["tp"], valid_vocab_size=self.dims.vocab_size
        ))  # fmt: skip

    @torch.no_grad()
    def compute_log_probs(
        self,
        batch: TokenBatch,
        *,
        with_entropy: bool = False,
        route_mode: RouteMode = None,
        replay: ReplayChecks = FULL_CHECKS,
        temperature: float = 1.0,
        top_k: int = 0,
    ) -> ScoreResult:
        """Per-token log-probs (and entropy; recorded routes or the replay agreement, per `route_mode`; with
        `top_k`, the `top_k` most likely next tokens and their log-probs at temperature 1) for the whole batch,
        identical on every rank; for a batch with `dp_share` set (this rank's rows only), for those rows, on this
        rank and its model-parallel peers (nothing is gathered over data-parallel ranks)."""
        self._check_resident("compute_log_probs")
        if top_k and temperature != 1.0:
            raise ValueError(f"top_k log-probs are taken at temperature 1, not {temperature}")
        self._set_training(False)
        plan = self._plan(batch)
        results: list[tuple[torch.Tensor | None, ...]] = []

        def loss_func(mb: TokenBatch, logits: torch.Tensor):
            logp, ent = self._packed_stats(mb, logits.float(), with_entropy, temperature)
            top: tuple[torch.Tensor | None, ...] = (None, None)
            if top_k:
                top = next_token_topk(
                    logits, mb.model_tokens(), logp, top_k, tp_group=self._groups["tp"],
                    valid_vocab_size=self.dims.vocab_size,
                )  # fmt: skip
            real = mb.size - mb.padding_rows
            results.append(tuple(None if v is None else mb.per_sample(v)[:real].cpu() for v in (logp, ent, *top)))
            return torch.zeros((), device=logits.device), torch.zeros((), dtype=torch.int), {}

        s = batch.input_ids.shape[1]
        _, routes, agreement = self._run(
            plan.batches, loss_func, forward_only=True, route_mode=route_mode, replay=replay, seq_len=s
        )
        return self._scores(plan, batch, results, with_entropy, routes, agreement, top_k=top_k)

    def _scores(
        self,
        plan: RankPlan,
        batch: TokenBatch,
        results: list[tuple[torch.Tensor | None, ...]],
        with_entropy: bool,
        routes: torch.Tensor | None = None,
        agreement: RouteAgreement | None = None,
        *,
        top_k: int = 0,
    ) -> ScoreResult:
        """The micro-batches' per-row `results` (log-probs, entropy[, top-k ids, top-k log-probs]; last pipeline
        stage) as `batch`'s rows on every stage."""
        s, shard, pp = batch.input_ids.shape[1], plan.shard, self._groups["pp"]

        def stacked(i: int, tail: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return stack_rows([r[i] for r in results], shard.size, s, pp, tail=tail, dtype=dtype)

        # Padding positions keep the routes they were actually given: replaying them reproduces the
        # recorded pass bitwise (expert GEMMs are not independent of the other tokens in the batch).
        valid = positions_below(shard.lengths, s)
        per_token = {"log_probs": stacked(0), "entropy": stacked(1) if with_entropy else None}
        if top_k:
            per_token["topk_ids"] = stacked(2, (top_k,), torch.long)
            per_token["topk_log_probs"] = stacked(3, (top_k,))
        for name, values in per_token.items():
            if values is not None:
                per_token[name] = torch.where(valid.view(*valid.shape, *[1] * (values.dim() - 2)), values, 0)
        rows = gather_rows(
            {**per_token, "routes": routes}, plan.index, batch.size, self._groups["dp"],
            gather=batch.dp_share is None,
        )  # fmt: skip
        return ScoreResult(**rows, agreement=agreement)

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        route_mode: Literal["replay"] | None = None,
        replay: ReplayChecks = FULL_CHECKS,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        skip_grad_norm_above: float | None = None,
        where: str = "this update",
    ) -> dict[str, float]:
        """One optimizer step over `batch` (this call's global batch) at the scheduled LR, which then advances;
        returns averaged metrics. `route_mode="replay"`: force `batch.routes` in the forward and the recompute
        forward; with `replay.agreement` the metrics include `routing/*` (replayed vs natural routes of the weights
        before this step). A NaN/inf loss or gradient on any rank stops the update before the optimizer moves:
        `on_nonfinite="stop"` raises `NonFiniteError` (naming `where` and the micro-batch); "skip" drops the
        gradients, leaves optimizer, schedule and `self.step` alone and returns `nonfinite_skipped` = 1. A finite
        grad norm above `skip_grad_norm_above` (`trainer.stop_on` action skip) is dropped the same way and returns
        `grad_norm_skipped` = 1 with the norm."""
        metrics, _ = self._update(
            batch, loss_fn, None, with_entropy, route_mode, replay, on_nonfinite, where, skip_grad_norm_above
        )
        return metrics

    def train_step_on_policy(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        *,
        route_mode: Literal["replay"] | None = None,
        replay: ReplayChecks = FULL_CHECKS,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        skip_grad_norm_above: float | None = None,
        where: str = "this update",
    ) -> tuple[dict[str, float], ScoreResult]:
        """`train_step` (with entropy) while the weights are still the old policy's (an RL step's first update):
        `loss_fn` sees `old_log_probs` = this forward's own detached log-probs, so the ratio is exactly 1, and
        those log-probs and the entropy come back per row of `batch` as `compute_log_probs` returns them. It
        spares the old-policy pass this mini-batch's forward."""
        metrics, scores = self._update(
            batch, loss_fn, None, True, route_mode, replay, on_nonfinite, where, skip_grad_norm_above, on_policy=True
        )
        assert scores is not None
        return metrics, scores

    def warmup_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        *,
        lr: float,
        route_mode: Literal["replay"] | None = None,
        replay: ReplayChecks = FULL_CHECKS,
    ) -> dict[str, float]:
        """One optimizer step at learning rate `lr` that leaves the LR schedule and `self.step` where they are
        (supervised warm-up stages; `lr=0` re-runs an update without moving the weights)."""
        return self._update(batch, loss_fn, lr, False, route_mode, replay, "stop", "this warm-up update")[0]

    def _update(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        lr: float | None,
        with_entropy: bool,
        route_mode: Literal["replay"] | None,
        replay: ReplayChecks,
        on_nonfinite: Literal["stop", "skip"],
        where: str,
        skip_grad_norm_above: float | None = None,
        *,
        on_policy: bool = False,
    ) -> tuple[dict[str, float], ScoreResult | None]:
        self._check_resident("train_step")
        self._set_training(True)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        plan = self._plan(batch)
        batches = plan.batches

        kept: list[tuple[torch.Tensor | None, ...]] = []

        def loss_func(mb: TokenBatch, logits: torch.Tensor):
            packed_logp, packed_ent = self._packed_stats(mb, logits, with_entropy, 1.0)
            student_topk = self._student_topk(mb, logits, packed_logp)
            logp, ent = mb.per_sample(packed_logp), mb.per_sample(packed_ent)
            if on_policy:
                mb.fields["old_log_probs"] = logp.detach()
                real = mb.size - mb.padding_rows
                kept.append((logp.detach()[:real].cpu(), None if ent is None else ent.detach()[:real].cpu()))
            extra = {} if student_topk is None else {"topk_log_probs": student_topk}
            loss_sum, count, metrics = loss_fn(logp, ent, mb, **extra)
            count = count.to(torch.int).reshape(())
            metrics = {k: float(v) for k, v in metrics.items()}
            metrics["_count"] = int(count)
            return loss_sum, count, {"loss_sum": loss_sum.detach().float(), "metrics": metrics}

        outputs, _, agreement = self._run(batches, loss_func, forward_only=False, route_mode=route_mode, replay=replay)
        scores = self._scores(plan, batch, kept, with_entropy) if on_policy else None
        totals = reduce_metric_sums(outputs, self._groups)
        overflow, grad_norm = training_setup.grad_norm_before_step(self.optimizer)
        problem = nonfinite_problem(totals, grad_norm, outputs, self.chunks, len(batches), where)
        if problem is not None:
            drop_nonfinite_update(problem, self.chunks, self.optimizer, on_nonfinite)
            return {**mean_metrics(totals, None, self.optimizer), "nonfinite_skipped": 1.0}, scores
        if grad_norm_too_large(grad_norm, skip_grad_norm_above, where):
            drop_gradients(self.chunks, self.optimizer)
            skipped = {**mean_metrics(totals, grad_norm, self.optimizer), "grad_norm_skipped": 1.0}
            if agreement is not None:  # measured in this update's forward: still the weights' routes
                skipped.update(agreement.as_metrics("routing/", self.dims.moe_layers))
            return skipped, scores
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        # A loss scaler (fp16) found an overflow the check above did not, or Megatron refused the step.
        if overflow or not training_setup.clip_and_step(self.optimizer, grad_norm):
            raise NonFiniteError(f"gradient overflow at {where}: the optimizer skipped the update")
        if lr is None:
            self.scheduler.step(increment=1)
            self.step += 1
        else:
            self.scheduler.step(increment=0)  # put the schedule's LR back
        metrics = mean_metrics(totals, grad_norm, self.optimizer, lr=lr)
        metrics["balance/dp_imbalance"] = plan.dp_imbalance
        if agreement is not None:  # replayed routes vs the routes these (pre-update) weights would choose
            metrics.update(agreement.as_metrics("routing/", self.dims.moe_layers))
        return metrics, scores
