"""The launch plan of a multi-node job: which node runs what, and whether it fits.

`make_plan(cfg, hf, cluster)` derives from the training config, the model's HF config and the node/GPU
counts: the trainer ranks with their Megatron coordinates (tensor/pipeline/data and expert-tensor/expert/
expert-data ranks, in Megatron-Core's default "tp-cp-ep-dp-pp" rank order), the SGLang servers and the
router, and a per-GPU memory estimate. An impossible plan raises `PlanError` listing every reason.
Pure arithmetic: no GPU, no SLURM and no Megatron import needed, so `megatron-rl launch --dry-run` works on
a laptop.

Modes: colocated (`trainer.colocate=true`: trainer ranks on every GPU of every node, SGLang servers share
those GPUs) and disaggregated (`trainer.colocate=false`: the first nodes train, the last
`cluster.rollout_nodes` serve SGLang behind a router, weights are broadcast over NCCL).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.launch.critic_memory import critic_memory
from megatron_rl.launch.lora_memory import lora_params
from megatron_rl.launch.model_memory import (
    HOST_BYTES_PER_PARAM,
    PCIE_BYTES_PER_PARAM,
    optimizer_bytes_per_param,
    shared_expert_gate,
    weight_shard,
)
from megatron_rl.launch.placement import (
    RolloutServer,
    SideServer,
    format_servers,
    place_servers,
    servers_shell,
)
from megatron_rl.models.architecture import model_dims, same_architecture
from megatron_rl.models.family import ModelDims, UnsupportedModelError
from megatron_rl.parallel_layout import LayoutError

GiB = 2**30
PCIE_GB_PER_S = 25.0
"""Effective host<->GPU bandwidth per GPU for the offloaded optimizer's copies (GB/s, 1e9 bytes): an H100 on PCIe
Gen5 x16 peaks at ~64 GB/s each way, but pageable fp32 copies from the HybridDeviceOptimizer's host tensors, eight
GPUs sharing the CPU sockets' links and per-parameter copies reach well below; 25 GB/s is an assumption, not a
measurement (override with ClusterSpec.pcie_gb_per_s)."""
CUDA_CONTEXT_GIB = 3.0  # CUDA context, NCCL buffers and allocator slack per GPU
SGLANG_RELEASED_GIB = 2.0  # what a colocated SGLang server keeps after releasing its memory (context, buffers)
ROUTER_PORT = 30100


class PlanError(ValueError):
    """The job cannot run as configured; the message lists every reason and a fix for each."""


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 80.0
    rollout_nodes: int = 0  # disaggregated: nodes that only serve SGLang (the last ones)
    pcie_gb_per_s: float = PCIE_GB_PER_S  # effective host<->GPU bandwidth per GPU (optimizer CPU offload)


@dataclass(frozen=True)
class TrainerRank:
    rank: int
    node: int
    local_rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the most loaded trainer rank (a pipeline stage holding embeddings)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    total: float
    budget: float  # what the trainer may use on its GPU (after SGLang's share when colocated)
    sglang_weights: float  # per GPU of a rollout server
    sglang_budget: float
    resident_in_rollout: float = 0.0  # the trainer's memory while a colocated SGLang generates
    sglang_kv_token_bytes: float = 0.0  # KV cache of one token, per GPU of a rollout server
    sglang_kv_tokens: float = 0.0  # tokens the rest of a server's share caches
    host_optimizer: float = 0.0  # optimizer.cpu_offload: the state this GPU's optimizer keeps in host memory
    host_per_node: float = 0.0  # host memory per node: every GPU's offloaded state, plus the parked actor
    pcie_seconds_per_step: float = 0.0  # the offloaded optimizer's copies per training step, at ClusterSpec's rate
    teacher: float = 0.0  # a resident Megatron distillation teacher's weights (another architecture than the actor's)
    lora: float = 0.0  # model.lora: the fp32 adapters' bytes (in weights; grads and optimizer are theirs alone)
    critic: float = 0.0  # algo.advantage=gae: the critic's weights, grads and optimizer state on the GPU

    def lines(self) -> list[str]:
        g = GiB
        teacher = f"+ teacher {self.teacher / g:.1f} " if self.teacher else ""
        lora = f"(LoRA: frozen base + {self.lora / 2**20:.0f} MiB of adapters) " if self.lora else ""
        critic = f"+ critic {self.critic / g:.1f} (weights, grads, optimizer) " if self.critic else ""
        lines = [
            f"  weights {self.weights / g:.1f} {lora}+ grads {self.grads / g:.1f} + optimizer {self.optimizer / g:.1f} "
            f"+ activations {self.activations / g:.1f} + logits {self.logits / g:.1f} {teacher}{critic}"
            f"= {self.total / g:.1f} GiB of {self.budget / g:.1f} GiB available to training",
            f"  rollout server weights {self.sglang_weights / g:.1f} GiB per GPU of {self.sglang_budget / g:.1f} GiB "
            f"(rollout.sglang.mem_fraction_static); the rest is KV cache: {self.sglang_kv_token_bytes / 2**10:.1f} "
            f"KiB per token per GPU, ~{self.sglang_kv_tokens / 1e3:.0f}k tokens per server",
        ]
        if self.host_optimizer:
            lines.insert(1, (
                f"  optimizer CPU offload: {self.host_optimizer / g:.1f} GiB of optimizer state per GPU in host memory "
                f"({self.host_per_node / g:.0f} GiB per node with the parked actor), ~{self.pcie_seconds_per_step:.1f} "
                "s of PCIe copies per step (gradients down, parameters up, every update)"
            ))  # fmt: skip
        return lines


@dataclass(frozen=True)
class Plan:
    mode: Literal["colocated", "disaggregated"]
    cluster: ClusterSpec
    layout: Any  # ResolvedLayout
    ranks: tuple[TrainerRank, ...]
    servers: tuple[RolloutServer, ...]
    router: tuple[int, int] | None  # (node, port)
    memory: MemoryEstimate
    params: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    side_servers: tuple[SideServer, ...] = ()  # the launched side models' (placement.py)

    @property
    def trainer_nodes(self) -> list[int]:
        return sorted({r.node for r in self.ranks})

    @property
    def rollout_nodes(self) -> list[int]:
        return sorted({s.node for s in self.servers} | {s.node for s in self.side_servers})


# ---------------------------------------------------------------------------------------------- planning
def make_plan(cfg, hf: dict, cluster: ClusterSpec, teacher_hf: dict | None = None) -> Plan:
    """The plan for `cfg` (RLConfig) of the model `hf` (HF config.json) on `cluster`; PlanError if impossible.
    `teacher_hf`: a Megatron distillation teacher's config.json (None: unknown, planned as the student's)."""
    reasons: list[str] = []
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise PlanError(f"need at least one node and one GPU per node, got {cluster.nodes} x {cluster.gpus_per_node}")
    colocated = cfg.trainer.colocate
    sglang = cfg.rollout.engine == "sglang"
    if colocated and cluster.rollout_nodes:
        reasons.append(
            f"rollout_nodes={cluster.rollout_nodes} with trainer.colocate=true: colocated runs put training and "
            "rollout on the same nodes; set trainer.colocate=false for separate rollout nodes"
        )
    if not colocated:
        if not sglang:
            reasons.append("trainer.colocate=false needs rollout.engine=sglang (the local engine lives in the trainer)")
        if not 0 < cluster.rollout_nodes < cluster.nodes:
            reasons.append(
                f"trainer.colocate=false needs 1 <= --rollout-nodes < --nodes (got {cluster.rollout_nodes} of "
                f"{cluster.nodes}): some nodes train, the others serve"
            )
    train_nodes = cluster.nodes if colocated else max(cluster.nodes - cluster.rollout_nodes, 1)
    world = train_nodes * cluster.gpus_per_node
    try:
        dims = model_dims(hf)
    except UnsupportedModelError as err:
        raise PlanError(f"impossible plan:\n  - {err}") from err
    layout = None
    try:
        layout = cfg.parallel.validate(world, **dims.layout_checks())
    except LayoutError as err:
        reasons.append(f"parallel layout on {world} training GPUs ({train_nodes} nodes): {err}")
    serving = [] if not sglang else list(range(cluster.nodes) if colocated else range(train_nodes, cluster.nodes))
    servers, side_servers, problems, placement_notes = place_servers(cfg, serving, cluster.gpus_per_node, colocated)
    reasons += problems
    router = (servers[0].node, ROUTER_PORT) if len(servers) > 1 else None
    teacher = _resident_teacher(cfg, hf, teacher_hf, world, reasons)
    memory, params = _memory(cfg, dims, shared_expert_gate(hf, dims), layout, cluster, colocated and sglang, teacher)
    if layout is not None and memory.total > memory.budget:
        reasons.append(
            f"training needs ~{memory.total / GiB:.1f} GiB per GPU but {memory.budget / GiB:.1f} GiB are available"
            + (f" (rollout.sglang.mem_fraction_static={cfg.rollout.sglang.mem_fraction_static} of the GPU is SGLang's"
               "; rollout.release_memory=true frees it during training)"
               if colocated and sglang and not cfg.rollout.release_memory else "")
            + ": raise tp/pp/ep, use more nodes, lower trainer.micro_batch_tokens, or enable "
            "model.options.recompute=full\n  " + memory.lines()[0]
        )  # fmt: skip
    if sglang and memory.sglang_weights > memory.sglang_budget:
        reasons.append(
            f"a rollout server's weights need {memory.sglang_weights / GiB:.1f} GiB per GPU but its share is "
            f"{memory.sglang_budget / GiB:.1f} GiB: raise rollout.sglang.tp_size or mem_fraction_static"
        )
    rollout_room = cluster.gpu_memory_gib * GiB * (1 - cfg.rollout.sglang.mem_fraction_static) - CUDA_CONTEXT_GIB * GiB
    if colocated and sglang and cfg.rollout.release_memory and memory.resident_in_rollout > rollout_room:
        reasons.append(
            f"while SGLang generates, the trainer keeps its weights, gradients and optimizer state "
            f"(~{memory.resident_in_rollout / GiB:.1f} GiB per GPU) but only {rollout_room / GiB:.1f} GiB are left "
            "beside SGLang's share: set trainer.offload_actor=true, or lower rollout.sglang.mem_fraction_static"
        )
    if reasons:
        raise PlanError("impossible plan:\n" + "\n".join(f"  - {r}" for r in reasons))
    ranks = tuple(_coordinates(rank, layout, cluster.gpus_per_node) for rank in range(world))
    notes = []
    if colocated and sglang and cfg.rollout.release_memory:
        notes.append(
            f"colocated: SGLang releases its weights, KV cache and CUDA graphs while the trainer runs (keeping "
            f"~{SGLANG_RELEASED_GIB:.0f} GiB); "
            + ("the actor's state waits in host memory while SGLang generates (trainer.offload_actor)"
               if cfg.trainer.offload_actor else "the actor's state stays on the GPU while SGLang generates")
        )  # fmt: skip
    elif colocated and sglang:
        notes.append(
            "colocated: SGLang keeps its mem_fraction_static share during training (rollout.release_memory=false), "
            "so training gets the rest"
        )
    if cfg.algo.kl_coef > 0:
        notes.append("KL reference: the base with LoRA adapters off (no copy, no host memory)" if cfg.model.lora.rank
                     else "KL reference weights are swapped from host memory (no extra GPU memory)")  # fmt: skip
    distill = cfg.algo.distill
    if distill.teacher is not None:
        notes.append({
            "megatron": f"distillation teacher of another architecture resident on every GPU in the actor's layout: "
            f"{memory.teacher / GiB:.1f} GiB of weights per GPU, counted above" if memory.teacher else
            f"distillation teacher swapped from host memory like the KL reference: {memory.weights / GiB:.1f} GiB of "
            "host memory per GPU, no extra GPU memory"
            + ("" if teacher_hf is not None else " (its config.json was not read: pass --teacher-hf-config if it is "
               "not the student's architecture)"),
            "local_engine": "distillation teacher on the local engine: a second model on rank 0's GPU, not counted "
            "above; prefer served_by=sglang at scale",
            "sglang": "distillation teacher on its own SGLang servers: "
            + ("a side model, planned above" if any(u.startswith("side:") for u in distill.sglang_urls)
               else "algo.distill.sglang_urls, not planned here"),
        }[distill.served_by])  # fmt: skip
    if memory.critic:
        notes.append(
            f"critic (algo.advantage=gae): a second model in the actor's layout, {memory.critic / GiB:.1f} GiB per GPU "
            "of weights, gradients and optimizer state, counted above (its passes run between the actor's)"
            + ("; algo.critic.hf_path is priced as the policy's architecture" if cfg.algo.critic.hf_path else "")
        )
    notes += placement_notes
    if cfg.trainer.mode == "async":
        k = cfg.trainer.max_staleness
        notes.append(
            f"async (trainer.max_staleness={k}): the servers generate the samples of step t+{k} while the trainer "
            f"trains step t; weights reach them "
            + ("by interrupting and continuing the requests in flight (rollout.partial)" if cfg.rollout.partial
               else "between requests")
            + ("; colocated, both share each GPU at once: prefer trainer.colocate=false" if colocated else "")
        )  # fmt: skip
    return Plan(
        "colocated" if colocated else "disaggregated",
        cluster,
        layout,
        ranks,
        tuple(servers),
        router,
        memory,
        params,
        tuple(notes),
        tuple(side_servers),
    )


def _coordinates(rank: int, layout, gpus_per_node: int) -> TrainerRank:
    """Megatron-Core's default order "tp-cp-ep-dp-pp": tp varies fastest, pp slowest; experts regroup each
    pipeline stage's ranks as etp (fastest) x ep x expert-dp."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    stage = tp * cp * dp
    etp, ep = layout.etp, layout.ep
    return TrainerRank(
        rank=rank,
        node=rank // gpus_per_node,
        local_rank=rank % gpus_per_node,
        tp=rank % tp,
        cp=(rank // tp) % cp,
        dp=(rank // (tp * cp)) % dp,
        pp=rank // stage,
        etp=rank % etp,
        ep=(rank // etp) % ep,
        edp=(rank % stage) // (etp * ep),
    )


# ---------------------------------------------------------------------------------------------- memory
def kv_cache_token_bytes(d: ModelDims, server_tp: int, dtype_bytes: int = 2) -> float:
    """Bytes of KV cache one token takes on each GPU of an SGLang server of `server_tp` GPUs.

    GQA: every layer's keys and values of the query groups a GPU holds (SGLang replicates a group over the GPUs
    when tp exceeds the group count). MLA: every layer's compressed latent and shared rotary key
    (kv_lora_rank + qk_rope_head_dim values), whole on every GPU (SGLang's MLATokenToKVPool)."""
    if d.kv_lora_rank:
        return d.num_layers * (d.kv_lora_rank + d.qk_rope_head_dim) * dtype_bytes
    groups_per_gpu = max(d.num_query_groups // server_tp, 1)
    return d.num_layers * 2 * groups_per_gpu * d.head_dim * dtype_bytes


def _resident_teacher(cfg, hf: dict, teacher_hf: dict | None, world: int, reasons: list[str]) -> float:
    """Parameters per GPU of a Megatron distillation teacher resident beside the actor (another architecture, built
    in the actor's layout); 0 for none (no teacher, an engine's, the student's architecture: swapped from the host,
    or an unknown one). A teacher the layout cannot run adds its reason."""
    distill = cfg.algo.distill
    if distill.teacher is None or distill.served_by != "megatron" or teacher_hf is None:
        return 0.0
    if same_architecture(hf, teacher_hf):
        return 0.0
    try:
        dims = model_dims(teacher_hf)
        layout = cfg.parallel.validate(world, **dims.layout_checks())
    except (UnsupportedModelError, LayoutError) as err:
        reasons.append(f"algo.distill.teacher={distill.teacher} in the actor's parallel layout: {err}")
        return 0.0
    dense, experts, _ = weight_shard(dims, shared_expert_gate(teacher_hf, dims), layout)
    return dense + experts


def _memory(
    cfg, d: ModelDims, shared_gate: bool, layout, cluster: ClusterSpec, colocated_sglang: bool, teacher_params: float
) -> tuple[MemoryEstimate, dict]:
    dense, experts, params = weight_shard(d, shared_gate, layout)
    tp, pp = (layout.tp, layout.pp) if layout else (1, 1)
    dp, edp = (layout.dp, layout.expert_dp) if layout else (1, 1)
    per_stage = max(layout.stage_layers) if layout and layout.stage_layers else math.ceil(d.num_layers / pp)
    h = d.hidden_size
    bf16 = cfg.model.options.dtype == "bf16"
    base = (dense + experts) * (2 if bf16 else 4)
    teacher = teacher_params * (2 if bf16 else 4)
    lora = cfg.model.lora
    if lora.rank:  # the base is frozen: only the fp32 adapters have gradients and optimizer state
        dense, experts = lora_params(d, lora, layout)
        params["lora"] = dense + experts
    weights = base + (dense + experts) * 4 if lora.rank else base
    grads = (dense + experts) * 4
    shard = dense / dp + experts / edp  # parameters whose optimizer state this GPU holds (distributed optimizer)
    opt = cfg.optimizer
    if not opt.distributed_optimizer:
        shard = dense + experts
    offloaded = opt.offload_fraction if opt.cpu_offload else 0.0
    optimizer = shard * (1 - offloaded) * optimizer_bytes_per_param(opt, bf16 and not lora.rank)
    host_optimizer = shard * offloaded * HOST_BYTES_PER_PARAM
    critic = critic_memory(cfg, d, shared_gate, layout)  # trains on the actor's mini-batches, offloads with it
    if critic is not None:
        params["critic"] = critic.params
        host_optimizer += critic.host_optimizer
    critic_bytes = critic.device if critic else 0.0
    trained = weights + grads + optimizer + critic_bytes  # what trainer.offload_actor parks in host memory
    updates = cfg.algo.mini_batches_per_step * cfg.algo.ppo_epochs
    crossing = shard * offloaded + (critic.offloaded if critic else 0.0)
    pcie = updates * crossing * PCIE_BYTES_PER_PARAM / (cluster.pcie_gb_per_s * 1e9)
    tokens = cfg.trainer.micro_batch_tokens
    act_bytes = 2 if bf16 else 4
    if cfg.model.options.recompute == "full":
        activations = tokens * h * act_bytes * (per_stage + 17)
    else:
        activations = tokens * h * act_bytes * 17 * per_stage / tp  # ~34 bytes/token/hidden per layer in bf16
    if pp > 1:
        activations *= min(pp, 2)  # in-flight micro-batches of 1F1B on the first stage
    logits = tokens * d.vocab_size / tp * act_bytes * 2  # logits and their gradient (the log-prob kernel is chunked)
    total = (trained + activations + logits + teacher) * 1.1  # the critic's passes: not beside the actor's
    gpu = cluster.gpu_memory_gib * GiB
    share = cfg.rollout.sglang.mem_fraction_static
    budget = gpu - CUDA_CONTEXT_GIB * GiB
    if colocated_sglang:  # SGLang keeps its share during training unless it releases it
        budget -= SGLANG_RELEASED_GIB * GiB if cfg.rollout.release_memory else gpu * share
    server_gpus = cfg.rollout.sglang.tp_size
    sglang_weights = params["total"] * 2 / server_gpus
    sglang_budget = gpu * share
    kv_token = kv_cache_token_bytes(d, server_gpus)
    kv_tokens = max(sglang_budget - sglang_weights, 0.0) / kv_token
    resident = (teacher + (0.0 if cfg.trainer.offload_actor else trained)) * 1.1
    parked = trained if cfg.trainer.offload_actor else 0.0
    host = cluster.gpus_per_node * (host_optimizer + parked)
    return MemoryEstimate(weights, grads, optimizer, activations, logits, total, budget, sglang_weights,
                          sglang_budget, resident, kv_token, kv_tokens, host_optimizer, host,
                          pcie, teacher, (dense + experts) * 4 if lora.rank else 0.0, critic_bytes), params  # fmt: skip


# ---------------------------------------------------------------------------------------------- output
def format_plan(plan: Plan) -> str:
    c, lay = plan.cluster, plan.layout
    out = [
        f"{plan.mode} plan: {c.nodes} node(s) x {c.gpus_per_node} GPU(s), {c.gpu_memory_gib:g} GiB each",
        f"model: {_count(plan.params['total'])} parameters ({_count(plan.params['experts'])} in experts, "
        f"{_count(plan.params['active'])} active per token)",
        f"trainer: {len(plan.ranks)} ranks on nodes {plan.trainer_nodes}: tp={lay.tp} pp={lay.pp}"
        f"{f' vpp={lay.vpp}' if lay.vpp else ''}{_uneven_stages(lay)} cp={lay.cp} dp={lay.dp} | "
        f"experts: etp={lay.etp} ep={lay.ep} "
        f"edp={lay.expert_dp}",
    ]
    for node in plan.trainer_nodes:
        ranks = [r for r in plan.ranks if r.node == node]
        out.append(f"  node {node}: ranks {ranks[0].rank}-{ranks[-1].rank}")
        for r in ranks:
            out.append(
                f"    gpu {r.local_rank}: rank {r.rank:<4} tp {r.tp} cp {r.cp} dp {r.dp} pp {r.pp} | "
                f"etp {r.etp} ep {r.ep} edp {r.edp}"
            )
    if plan.servers:
        out.extend(format_servers(plan.servers, plan.side_servers, plan.rollout_nodes))
        if plan.router:
            out.append(f"  sglang-router on node {plan.router[0]}, port {plan.router[1]}")
    else:
        out.append("rollout: the embedded local engine in trainer rank 0")
    out.append("memory per GPU (estimate, most loaded pipeline stage):")
    memory = plan.memory.lines()
    out.extend(memory if plan.servers else memory[:-1])  # the last line is the rollout servers'
    out.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(out)


def _uneven_stages(layout) -> str:
    stages = layout.stage_layers or ()
    return f" (layers per stage {'/'.join(map(str, stages))})" if len(set(stages)) > 1 else ""


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def shell_plan(plan: Plan, cfg) -> str:
    """The plan as shell assignments (node indices into the job's node list), for scripts/slurm/*.sbatch."""
    values = {
        "PLAN_MODE": plan.mode,
        "PLAN_ROLLOUT_ENGINE": cfg.rollout.engine,
        "PLAN_MODEL_PATH": cfg.model.hf_path,
        "PLAN_TRAIN_NODES": " ".join(map(str, plan.trainer_nodes)),
        "PLAN_ROLLOUT_NODES": " ".join(map(str, plan.rollout_nodes)),
        "PLAN_TRAINER_RANKS_PER_NODE": str(plan.cluster.gpus_per_node),
        "PLAN_SERVER_TP": str(cfg.rollout.sglang.tp_size),
        "PLAN_SERVER_EP": str(cfg.rollout.sglang.ep_size),
        "PLAN_SERVER_MEM_FRACTION": str(cfg.rollout.sglang.mem_fraction_static),
        "PLAN_ROUTER_NODE": str(plan.router[0]) if plan.router else "",
        "PLAN_ROUTER_PORT": str(plan.router[1]) if plan.router else "",
        "PLAN_ROUTER_POLICY": cfg.rollout.sglang.router_policy,
        "PLAN_R3": "1" if cfg.algo.routing_replay == "R3" else "",
        "PLAN_MEMORY_SAVER": "1" if cfg.rollout.release_memory else "",
        **servers_shell(cfg, plan.servers, plan.side_servers),
    }
    return "\n".join(f"{k}={shlex.quote(v)}" for k, v in values.items())
