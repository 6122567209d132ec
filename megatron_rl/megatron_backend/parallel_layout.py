"""The parallel layout of a Megatron-Core job, validated once, before anything is built.

`ParallelLayout` holds the degrees a user chooses (tp, pp, vpp, ep, etp, cp, sp); the data
parallel degree is what is left of the world size. Everything else asks this object: the
process groups (`initialize`), the model config (`to_model_parallel_config_kwargs`), and the
checks that Megatron would otherwise only fail on deep inside a run, or not at all
(`validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class LayoutError(ValueError):
    """A parallel layout that cannot work for the given world size or model."""


@dataclass(frozen=True)
class ResolvedLayout:
    """A `ParallelLayout` bound to a world size: every degree, including the derived ones."""

    world_size: int
    tp: int
    pp: int
    vpp: int | None
    ep: int
    etp: int
    cp: int
    dp: int
    """Data-parallel degree of the dense (non-expert) part: world / (tp * pp * cp)."""
    expert_dp: int
    """Data-parallel degree of the experts: world / (etp * ep * pp)."""
    sp: bool


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism of a Megatron-Core job; dp is derived from the world size."""

    tp: int = field(default=1, metadata={"help": "Tensor-parallel degree: ranks that split each weight matrix."})
    pp: int = field(default=1, metadata={"help": "Pipeline-parallel degree: ranks that split the layer stack."})
    vpp: int | None = field(
        default=None,
        metadata={
            "help": "Virtual pipeline stages (model chunks) per pipeline rank for the interleaved "
            "1F1B schedule; None for no interleaving. Needs pp > 1."
        },
    )
    ep: int = field(
        default=1, metadata={"help": "Expert-parallel degree: ranks that split the experts of a MoE layer."}
    )
    etp: int | None = field(
        default=None,
        metadata={"help": "Tensor-parallel degree inside each expert; None means the same as tp."},
    )
    cp: int = field(default=1, metadata={"help": "Context-parallel degree: ranks that split each sequence."})
    sp: bool | None = field(
        default=None,
        metadata={
            "help": "Sequence parallelism over the TP group for norms/dropout; None means on "
            "exactly when tp > 1. MoE with tp > 1 requires it."
        },
    )

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise LayoutError(f"etp must be a positive integer or None, got {self.etp!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 2:
                raise LayoutError(f"vpp must be None (no interleaving) or an integer >= 2, got {self.vpp!r}")
            if self.pp < 2:
                raise LayoutError(
                    f"vpp={self.vpp} requires pp > 1: the interleaved schedule splits each "
                    f"pipeline rank's layers into chunks, and there is no pipeline at pp={self.pp}"
                )
        if self.sp and self.tp == 1:
            raise LayoutError(
                "sp=True requires tp > 1: sequence parallelism shards activations over the tensor-parallel group"
            )

    @property
    def sequence_parallel(self) -> bool:
        """Whether sequence parallelism is on (sp, or tp > 1 when sp is None)."""
        return self.sp if self.sp is not None else self.tp > 1

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel degree inside experts (etp, or tp when etp is None)."""
        return self.etp if self.etp is not None else self.tp

    def dp(self, world_size: int) -> int:
        """Data-parallel degree for `world_size` ranks; raises LayoutError if it does not divide."""
        return self.resolve(world_size).dp

    def resolve(self, world_size: int) -> ResolvedLayout:
        """Bind to a world size, checking the two rules that depend only on it.

        1. world_size must be divisible by tp * pp * cp (the rest is dp).
        2. Expert-parallel folding (parallel_state.initialize_model_parallel): the expert
           groups (etp x ep x expert-dp) are laid over the same ranks as one pipeline stage,
           so world_size must be divisible by etp * ep * pp, i.e. ep * etp must divide
           dp * cp * tp.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise LayoutError(f"world size must be a positive integer, got {world_size!r}")
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {model} "
                f"(tp={self.tp}, pp={self.pp}, cp={self.cp}); the data-parallel degree "
                "world/(tp*pp*cp) must be a whole number"
            )
        dp = world_size // model
        stage_ranks = dp * self.cp * self.tp
        experts = self.ep * self.expert_tp
        if stage_ranks % experts:
            raise LayoutError(
                f"expert parallelism does not fold into the layout: ep*etp = {self.ep}*"
                f"{self.expert_tp} = {experts} must divide dp*cp*tp = {dp}*{self.cp}*{self.tp}"
                f" = {stage_ranks}, the ranks of one pipeline stage that Megatron regroups "
                f"into expert-tensor x expert x expert-data groups (world size {world_size}); "
                "lower ep or set etp (tensor parallelism inside experts, default = tp), e.g. etp=1"
            )
        return ResolvedLayout(
            world_size=world_size,
            tp=self.tp,
            pp=self.pp,
            vpp=self.vpp,
            ep=self.ep,
            etp=self.expert_tp,
            cp=self.cp,
            dp=dp,
            expert_dp=stage_ranks // experts,
            sp=self.sequence_parallel,
        )

    def validate(
        self,
        world_size: int,
        *,
        num_layers: int | None = None,
        num_experts: int | None = None,
        num_attention_heads: int | None = None,
        num_query_groups: int | None = None,
        is_moe: bool = True,
        batch_p2p_comm: bool = False,
    ) -> ResolvedLayout:
        """Check this layout against a world size and a model; raise LayoutError saying why.

        Model sizes left as None are not checked. `batch_p2p_comm` is the value the
        ModelParallelConfig will carry (`to_model_parallel_config_kwargs` sets False with vpp).
        """
        resolved = self.resolve(world_size)
        if num_experts is not None and num_experts % self.ep:
            raise LayoutError(
                f"num_experts={num_experts} is not divisible by ep={self.ep}: every expert-"
                "parallel rank must hold the same number of experts"
            )
        if num_attention_heads is not None and num_attention_heads % self.tp:
            raise LayoutError(
                f"num_attention_heads={num_attention_heads} is not divisible by tp={self.tp}: "
                "tensor parallelism splits attention by heads"
            )
        if num_query_groups is not None and num_query_groups % self.tp:
            raise LayoutError(
                f"num_query_groups={num_query_groups} is not divisible by tp={self.tp}: "
                "tensor parallelism splits the key/value heads (query groups) too"
            )
        if num_layers is not None:
            chunks = self.pp * (self.vpp or 1)
            if num_layers % chunks:
                what = f"pp*vpp = {self.pp}*{self.vpp} = {chunks}" if self.vpp else f"pp = {chunks}"
                raise LayoutError(
                    f"num_layers={num_layers} is not divisible by {what}: every "
                    "pipeline stage (and virtual stage) must hold the same number of layers"
                )
        if is_moe and self.tp > 1 and not self.sequence_parallel:
            raise LayoutError(
                f"MoE with tp={self.tp} requires sequence parallelism, but sp=False: Megatron's "
                "MoE layer refuses TP without SP (tokens would be routed redundantly on every "
                "TP rank); leave sp=None or set sp=True"
            )
        if self.vpp is not None and self.pp == 2 and batch_p2p_comm:
            raise LayoutError(
                f"interleaved pipeline (vpp={self.vpp}) at pp=2 with batch_p2p_comm=True "
                "silently mis-pairs messages: the previous and next stage are the same rank, so "
                "one batch holds two sends/receives to the same peer and an activation can be "
                "received where a gradient was sent (wrong losses, no error). Use "
                "batch_p2p_comm=False (to_model_parallel_config_kwargs does)"
            )
        return resolved

    def to_model_parallel_config_kwargs(self, *, pipeline_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Keyword arguments for TransformerConfig / ModelParallelConfig.

        Args:
            pipeline_dtype: dtype of activations sent between pipeline stages (normally the
                params dtype); Megatron requires it when pp > 1. Included only when given.
        """
        kwargs: dict[str, Any] = {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.expert_tp,
            "sequence_parallel": self.sequence_parallel,
        }
        if pipeline_dtype is not None:
            kwargs["pipeline_dtype"] = pipeline_dtype
        if self.vpp is not None:
            # Separate send/recv groups per direction; batching mis-pairs at pp=2 (see validate).
            kwargs["batch_p2p_comm"] = False
            kwargs["overlap_p2p_comm"] = False
        return kwargs

    def initialize(self) -> ResolvedLayout:
        """Create Megatron's process groups (parallel_state) for this layout.

        torch.distributed must already be initialised; the world-size rules are checked
        first (`resolve`), model rules are the caller's (`validate`).
        """
        resolved = self.resolve(torch.distributed.get_world_size())
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
        )
        return resolved

    @staticmethod
    def destroy() -> None:
        """Tear down Megatron's process-group state (parallel_state) so another layout can start."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
