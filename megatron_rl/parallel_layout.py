"""The parallel layout of a Megatron-Core job, validated once, before anything is built.

`ParallelLayout` holds the degrees a user chooses (tp, pp, vpp, ep, etp, cp, sp); the data
parallel degree is what is left of the world size. Everything else asks this object: the
process groups (`initialize`), the model config (`to_model_parallel_config_kwargs`), the layers
of each pipeline stage (`stage_layers`, even or set by pp_first/last_stage_layers), and the
checks that Megatron would otherwise only fail on deep inside a run, or not at all
(`validate`).
"""

from __future__ import annotations

import dataclasses
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
    stage_layers: tuple[int, ...] | None = None
    """Transformer layers of each pipeline stage, first to last; None when the model's layer count was not given."""


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
    pp_first_stage_layers: int | None = field(
        default=None,
        metadata={
            "help": "Transformer layers on the first pipeline stage (Megatron's num_layers_in_first_pipeline_stage); "
            "None splits the layers evenly. Set it (and/or pp_last_stage_layers) when the layer count does not "
            "divide by pp; the stages between first and last share the rest evenly. Needs pp > 1."
        },
    )
    pp_last_stage_layers: int | None = field(
        default=None,
        metadata={
            "help": "Transformer layers on the last pipeline stage (Megatron's num_layers_in_last_pipeline_stage), "
            "which also computes the output layer and loss; None splits the layers evenly. Needs pp > 1."
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
        for name in ("pp_first_stage_layers", "pp_last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer or None (even split), got {value!r}")
            if self.pp < 2:
                raise LayoutError(
                    f"{name}={value} requires pp > 1: it sizes a pipeline stage, and there is no pipeline "
                    f"at pp={self.pp}"
                )
            if self.vpp is not None:
                # Megatron-Core (0.16 and 0.19) accepts uneven stages with interleaving, but this project's
                # interleaved schedule is verified with even stages only.
                raise LayoutError(
                    f"{name}={value} with vpp={self.vpp}: uneven pipeline stages are supported without "
                    "interleaving only; set vpp=null, or choose pp*vpp dividing the layer count"
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
        stage_layers = self.check_model(
            num_layers=num_layers, num_experts=num_experts, num_attention_heads=num_attention_heads,
            num_query_groups=num_query_groups, is_moe=is_moe, batch_p2p_comm=batch_p2p_comm,
        )  # fmt: skip
        return dataclasses.replace(resolved, stage_layers=stage_layers)

    def check_model(
        self,
        *,
        num_layers: int | None = None,
        num_experts: int | None = None,
        num_attention_heads: int | None = None,
        num_query_groups: int | None = None,
        is_moe: bool = True,
        batch_p2p_comm: bool = False,
    ) -> tuple[int, ...] | None:
        """The model rules of `validate` alone (no world size): a model's sizes against these degrees; its layers per
        pipeline stage (`stage_layers`), or None when `num_layers` is None. Raises LayoutError saying why."""
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
        stage_layers = None if num_layers is None else self.stage_layers(num_layers)
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
        return stage_layers

    @property
    def uneven_stages(self) -> bool:
        """Whether the first or last pipeline stage has an explicit layer count."""
        return self.pp_first_stage_layers is not None or self.pp_last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers of each pipeline stage, first to last, as Megatron-Core splits `num_layers`.

        Raises LayoutError saying why the split is impossible; when the layers do not divide evenly by pp, the
        message proposes `pp_first_stage_layers` / `pp_last_stage_layers` values that do.
        """
        if not self.uneven_stages:
            chunks = self.pp * (self.vpp or 1)
            if num_layers % chunks:
                if self.vpp:
                    what = f"pp*vpp = {self.pp}*{self.vpp} = {chunks}"
                    fix = "Choose a vpp that divides the layers of each stage, or vpp=null."
                else:
                    what, fix = f"pp = {chunks}", uneven_split_hint(num_layers, self.pp)
                raise LayoutError(
                    f"num_layers={num_layers} is not divisible by {what}: every pipeline stage (and virtual "
                    f"stage) must hold the same number of layers. {fix}"
                )
            return (num_layers // self.pp,) * self.pp
        first, last = self.pp_first_stage_layers, self.pp_last_stage_layers
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        given = ", ".join(
            f"{name}={value}"
            for name, value in (("pp_first_stage_layers", first), ("pp_last_stage_layers", last))
            if value is not None
        )
        if middle_layers < middle_stages or (middle_stages == 0 and middle_layers):
            raise LayoutError(
                f"{given} do not fit num_layers={num_layers} at pp={self.pp}: that leaves {middle_layers} layer(s) "
                f"for {middle_stages} other stage(s), but each stage holds at least one layer and together they "
                f"hold all {num_layers}. {uneven_split_hint(num_layers, self.pp)}"
            )
        if middle_stages and middle_layers % middle_stages:
            raise LayoutError(
                f"{given} leave {middle_layers} layers for the other {middle_stages} pipeline stages, which must "
                f"split them evenly. {uneven_split_hint(num_layers, self.pp)}"
            )
        middle = (middle_layers // middle_stages,) * middle_stages if middle_stages else ()
        return (*(() if first is None else (first,)), *middle, *(() if last is None else (last,)))

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
        if self.uneven_stages:  # TransformerConfig fields (not ModelParallelConfig's); only when set
            kwargs["num_layers_in_first_pipeline_stage"] = self.pp_first_stage_layers
            kwargs["num_layers_in_last_pipeline_stage"] = self.pp_last_stage_layers
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


def propose_uneven_split(num_layers: int, pp: int) -> tuple[int, int] | None:
    """(first, last) stage layer counts that split `num_layers` over `pp` stages with the smallest largest stage.

    The stages between share the rest evenly. Among splits with the same largest stage, the last stage gets the
    fewer layers (it also runs the output layer and the loss), then the most even one wins. None when no split
    exists (fewer layers than stages).
    """
    if pp < 2 or num_layers < pp:
        return None
    best: tuple[tuple[int, bool, int], tuple[int, int]] | None = None
    middle_stages = pp - 2
    for per_middle in range(1, num_layers + 1) if middle_stages else (0,):
        rest = num_layers - middle_stages * per_middle
        for last in range(1, rest):
            first = rest - last
            key = (max(first, last, per_middle), last > first, first**2 + last**2 + middle_stages * per_middle**2)
            if best is None or key < best[0]:
                best = (key, (first, last))
    return None if best is None else best[1]


def uneven_split_hint(num_layers: int, pp: int) -> str:
    """What to set when `num_layers` does not split over `pp` stages as configured (for error messages)."""
    split = propose_uneven_split(num_layers, pp)
    if split is None:
        return f"{num_layers} layers cannot fill {pp} pipeline stages: lower pp."
    return (
        f"Set parallel.pp_first_stage_layers={split[0]} and parallel.pp_last_stage_layers={split[1]} "
        f"(uneven stages, without vpp), or choose a pp that divides {num_layers}."
    )
