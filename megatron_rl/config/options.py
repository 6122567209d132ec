"""The option types of the Megatron backend: how the model is built, adapted (LoRA) and optimised; and which LoRA
adapters SGLang serves itself (`rollout.lora_sync=adapter`), checked at load time.

Plain dataclasses (no Megatron import), so the config schema can hold them without building anything.

SGLang 0.5.23 (`--enable-lora`, `/load_lora_adapter_from_tensors`) adapts the projections it knows by their HF
names; this package sends it attention's adapters only (q/k/v, which SGLang stacks into its `qkv_proj`, and o_proj):
* routed experts: SGLang's MoE LoRA (`FusedMoEWithLoRA`) reads an expert's adapter as `experts.{e}.gate_proj...`
  or as 3-D stacks, not in peft's `target_parameters` layout that `lora/peft_format.py` writes;
* a dense layer's MLP or the shared experts: SGLang's `gate_up_proj`/`down_proj` targets on an MoE model also
  cover the routed experts, whose adapters these are not;
* Multi-Latent Attention has no q/k/v projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.models.family import get_family
from megatron_rl.models.hf_config import read_hf_config_if_present


@dataclass(frozen=True)
class ModelOptions:
    """How to build the model, independent of its architecture."""

    dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata={"help": "parameter and compute dtype"})
    layer_spec: Literal["auto", "local", "te"] = field(
        default="auto", metadata={"help": "'te' = Transformer Engine layers (GPU); 'local' = pure Megatron-Core"}
    )
    recompute: Literal["none", "full", "selective"] = field(
        default="none", metadata={"help": "activation recompute granularity"}
    )
    routing_replay: bool = field(
        default=True,
        metadata={
            "help": "build routers with Megatron's RouterReplay: needed to record or replay routes (R2/R3); "
            "routing is unchanged while no replay action is set"
        },
    )
    dispatcher: Literal["alltoall", "allgather"] = field(default="alltoall", metadata={"help": "MoE token dispatcher"})
    aux_loss_coeff: float = field(default=0.0, metadata={"help": "MoE load-balancing auxiliary loss coefficient"})
    expert_bias_update_rate: float = field(
        default=0.0,
        metadata={
            "help": "routers with a score-correction bias (DeepSeek-V3, GLM-4.5): how far each update moves the "
            "bias toward balanced expert loads (Megatron's moe_router_bias_update_rate; DeepSeek-V3 pre-training "
            "used 1e-3). 0 keeps the checkpoint's bias, so routing changes only through the trained router weights"
        },
    )
    logprob_impl: Literal["auto", "torch", "chunked", "triton"] = field(
        default="chunked",
        metadata={
            "help": "token log-prob/entropy kernel over vocab-parallel logits: chunked (memory-bounded torch, "
            "any device); triton = fused Triton kernels (GPU); auto = triton on GPU, chunked on CPU; torch = the "
            "unchunked reference"
        },
    )
    experts: Literal["auto", "sequential", "grouped"] = field(
        default="auto",
        metadata={
            "help": "how a MoE layer's local experts compute: sequential = one small GEMM pair per expert "
            "(Megatron's SequentialMLP); grouped = all experts in one grouped computation with the same parameters; "
            "auto = grouped where it is supported"
        },
    )
    packing: bool = field(
        default=True,
        metadata={
            "help": "pack samples into micro-batches by token budget without padding between them (THD with "
            "cu_seqlens on Transformer Engine; a block-diagonal causal mask on the local spec); false = the padded "
            "layout, one sample per row"
        },
    )
    local_attention: Literal["sdpa", "unfused"] = field(
        default="sdpa",
        metadata={
            "help": "core attention of the local layer spec: sdpa = torch's scaled_dot_product_attention (fused "
            "kernels on CPU and GPU); unfused = Megatron's local DotProductAttention (baddbmm + masked softmax). "
            "Transformer Engine's spec uses its own attention either way"
        },
    )
    seed: int = field(default=1234, metadata={"help": "initialisation seed (weights are then usually loaded)"})


@dataclass(frozen=True)
class OptimizerOptions:
    """Megatron optimizer and LR schedule."""

    lr: float = field(default=1e-5, metadata={"help": "peak learning rate"})
    min_lr: float = field(default=0.0, metadata={"help": "final learning rate of the decay"})
    lr_schedule: Literal["constant", "linear", "cosine"] = field(default="constant", metadata={"help": "LR decay"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    total_steps: int = field(default=1000, metadata={"help": "optimizer steps over which the LR decays"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    adam_beta1: float = field(default=0.9, metadata={"help": "Adam beta1"})
    adam_beta2: float = field(default=0.999, metadata={"help": "Adam beta2"})
    adam_eps: float = field(default=1e-8, metadata={"help": "Adam epsilon"})
    clip_grad: float = field(default=1.0, metadata={"help": "global gradient-norm clip (0 = off)"})
    distributed_optimizer: bool = field(default=True, metadata={"help": "shard optimizer state over DP ranks"})
    cpu_offload: bool = field(
        default=False,
        metadata={
            "help": "keep the optimizer state and fp32 main parameters in host memory and step there (Megatron's "
            "hybrid device optimizer, --optimizer-cpu-offload); needs the distributed optimizer"
        },
    )
    offload_fraction: float = field(
        default=1.0, metadata={"help": "with cpu_offload: the share of the optimizer state kept on the host"}
    )
    overlap_offload_transfers: bool = field(
        default=True,
        metadata={"help": "with cpu_offload: overlap the device-to-host gradient and host-to-device parameter copies"},
    )
    precision_aware: bool = field(
        default=False,
        metadata={
            "help": "Megatron's precision-aware optimizer: main parameters and Adam moments in the dtypes below "
            "(--use-precision-aware-optimizer)"
        },
    )
    main_params_dtype: Literal["fp32", "fp16"] = field(
        default="fp32", metadata={"help": "with precision_aware: dtype of the main (master) parameters"}
    )
    moments_dtype: Literal["fp32", "bf16", "fp16", "fp8"] = field(
        default="fp32", metadata={"help": "with precision_aware: dtype of Adam's first and second moments"}
    )


LoRATarget = Literal["attention", "mlp", "shared_experts", "experts"]


@dataclass(frozen=True)
class LoRAOptions:
    """Low-rank adapters on the policy's linear layers; the base weights stay frozen (Hu et al., LoRA,
    arXiv 2106.09685): `y = W x + (alpha / rank) · B A x`, B = 0 at the start."""

    rank: int = field(default=0, metadata={"help": "adapter rank r; 0 = no adapters (every weight trains)"})
    alpha: float = field(default=16.0, metadata={"help": "scaling numerator: the update is (alpha / rank) · B A"})
    dropout: float = field(
        default=0.0,
        metadata={
            "help": "dropout on the adapters' input; only 0 is accepted: dropout makes the training forward differ "
            "from the scoring forward, so the first update's ratio would not be 1 (ppo_kl_first != 0)"
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "a peft LoRA adapter directory (adapter_config.json + adapter_model.safetensors, e.g. written by "
            "`megatron-rl convert lora-to-hf`) to start from instead of B = 0; its r and lora_alpha must be these"
        },
    )
    targets: tuple[LoRATarget, ...] = field(
        default=("attention", "mlp", "shared_experts", "experts"),
        metadata={
            "help": "layers that get adapters: attention (QKV and output projections), mlp (dense layers' MLP), "
            "shared_experts, experts (every routed expert's fc1 and fc2); routers never"
        },
    )
    share_expert_a: bool = field(
        default=False,
        metadata={
            "help": "one A per MoE layer shared by its routed experts (one for fc1, one for fc2), each expert its own "
            "B: (experts - 1) x rank x (hidden + moe_ffn) fewer parameters per layer; a peft export gives every "
            "expert a copy of it, and a peft adapter loads only if its experts' A are equal"
        },
    )


SERVED_TARGETS = ("attention",)
# The Megatron weights the attention target adapts (`lora/adapters.py`), and the HF projections SGLang serves there.
_ATTENTION = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight")
_SGLANG_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_FIX = "use model.lora.targets=[attention] or rollout.lora_sync=merged"


def sglang_lora_modules(hf: dict[str, Any], targets: tuple[str, ...]) -> tuple[str, ...]:
    """The HF projections SGLang adapts for `targets` on the model of `hf` (its `--lora-target-modules`); a
    `ValueError` naming the fix when it cannot serve them."""
    _check_targets(targets)
    weights = get_family(hf).weight_map(hf)
    modules: list[str] = []
    for weight in _ATTENTION:
        rule = weights.rule(f"decoder.layers.0.{weight}")
        names = [] if rule is None else [h.removesuffix(".weight").rsplit(".", 1)[-1] for h in rule.hf]
        if not names or set(names) - set(_SGLANG_ATTENTION):
            raise ValueError(
                f"rollout.lora_sync=adapter: this {hf.get('model_type')} model's attention ({names or weight}) is not "
                "the q/k/v/o_proj SGLang serves adapters on; use rollout.lora_sync=merged"
            )
        modules += names
    return tuple(dict.fromkeys(modules))


def _check_targets(targets: tuple[str, ...]) -> None:
    unserved = [t for t in targets if t not in SERVED_TARGETS]
    if unserved:
        raise ValueError(
            f"rollout.lora_sync=adapter: SGLang cannot serve adapters on {unserved} (config/options.py says why); "
            f"{_FIX}"
        )


def check_lora_sync(cfg: Any, errors: list[str], notes: list[str]) -> None:
    rollout, lora = cfg.rollout, cfg.model.lora
    if rollout.lora_sync != "adapter":
        return
    problems = {
        "needs adapters: set model.lora.rank > 0": lora.rank <= 0,
        "needs rollout.engine=sglang (the local engine computes with merged weights: rollout.lora_sync=merged)":
            rollout.engine != "sglang",
        "needs trainer.mode=sync: SGLang unloads an adapter only after the requests using it finish, which an async "
        "update cannot wait for": cfg.trainer.mode == "async",
        "with rollout.release_memory: the released base is discarded and an adapter sync sends none; use "
        "rollout.lora_sync=merged": rollout.release_memory,
    }  # fmt: skip
    errors += [f"rollout.lora_sync=adapter {problem}" for problem, bad in problems.items() if bad]
    if lora.rank <= 0:
        return
    hf = read_hf_config_if_present(cfg.model.hf_path)
    try:  # without config.json yet (a model built later) its attention is checked when the engine starts
        _check_targets(lora.targets)
        modules = sglang_lora_modules(hf, lora.targets) if hf is not None else ()
    except ValueError as err:
        errors.append(str(err))
        return
    if rollout.sglang.urls and modules:
        notes.append(
            f"rollout.lora_sync=adapter with rollout.sglang.urls: the servers must run with --enable-lora "
            f"--max-lora-rank {lora.rank} --lora-target-modules {' '.join(modules)}"
        )
