"""The configuration tree of a training run: one frozen dataclass per section, every field with help text.

    RLConfig
      model      ModelConfig      (options: config.options.ModelOptions)
      parallel   ParallelLayout   (megatron_rl.parallel_layout)
      optimizer  OptimizerOptions (config.options)
      algo       AlgoConfig
      rollout    RolloutConfig    (sampling: rollout.engine.SamplingParams, sglang: SGLangConfig, side_models)
      data       DataConfig
      warmup     WarmupConfig
      trainer    TrainerConfig
      logging    LoggingConfig
      plugins    modules imported at start-up (rewards, environments, tools they register)

Field metadata: ``help`` (every field), optional bounds ``ge`` / ``gt`` / ``le`` checked when a value is
read, and ``registry`` (a ``megatron_rl.algorithms`` registry whose names are the valid values).
Loading, overrides and presets: ``loader.py``; checks that involve several fields: ``validation.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.config.fields import setting
from megatron_rl.config.options import LoRAOptions, ModelOptions, OptimizerOptions
from megatron_rl.config.sampling import SamplingParams, TurnLimits
from megatron_rl.config.side_models import SideModel
from megatron_rl.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class ModelConfig:
    """The policy model: where its HF checkpoint lives and how Megatron builds it."""

    hf_path: str = setting(
        help="Hugging Face model directory (config.json, *.safetensors, tokenizer); required. The actor, "
        "the reference model and the rollout engine all load it"
    )
    tokenizer_path: str | None = setting(
        None, help="tokenizer directory; null = hf_path (filled in when the config is loaded)"
    )
    build_tiny_if_missing: bool = setting(
        False,
        help="if hf_path does not exist, build a tiny random Qwen3-MoE there (megatron_rl.tiny_model) first: "
        "the embedded CPU demo needs no download",
    )
    options: ModelOptions = setting(
        default_factory=ModelOptions, help="how Megatron-Core builds the model (dtype, layer spec, recompute, ...)"
    )
    lora: LoRAOptions = setting(
        default_factory=LoRAOptions,
        help="low-rank adapters (rank > 0): only they train, the base stays frozen; the KL reference is the base "
        "with the adapters off",
    )


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang rollout servers: connect to running ones or launch them on this node."""

    urls: tuple[str, ...] = setting((), help="running servers (http://host:port); empty = launch num_servers")
    router_url: str = setting(
        "", help="with urls: a running sglang-router in front of them; generation goes through it, weights to each"
    )
    trainer_address: str = setting(
        "127.0.0.1",
        help="address the servers use to reach trainer rank 0 for weight_sync=distributed (the trainer's first "
        "node in multi-node jobs; scripts/slurm sets it)",
    )
    num_servers: int = setting(1, help="servers to launch when urls is empty", ge=1)
    tp_size: int = setting(1, help="GPUs per launched server (SGLang --tp-size)", ge=1)
    ep_size: int = setting(1, help="expert-parallel size inside a launched server (SGLang --ep-size)", ge=1)
    mem_fraction_static: float = setting(
        0.7, help="GPU memory fraction a launched server takes for weights and KV cache", gt=0, le=1
    )
    base_port: int = setting(30000, help="port of the first launched server; the others count up", ge=1, le=65535)
    router: bool = setting(False, help="launch sglang-router in front of the servers and generate through it")
    router_port: int = setting(30100, help="port of the launched router", ge=1, le=65535)
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = setting(
        "cache_aware", help="load-balancing policy of the launched router"
    )
    startup_timeout_s: float = setting(600.0, help="seconds to wait for servers to become healthy", gt=0)
    group_timeout_s: float = setting(
        120.0,
        help="weight_sync=distributed: seconds the broadcast group may take to form, and one collective of a "
        "weight transfer to finish, before the sync fails naming the address and ranks",
        gt=0,
    )
    request_timeout_s: float = setting(1800.0, help="seconds one generate request may take", gt=0)
    python: str = setting("python3", help="Python executable with sglang installed, used to launch the servers")
    extra_args: tuple[str, ...] = setting((), help="further `sglang.launch_server` flags for launched servers")
    api_key_file: str | None = setting(
        None,
        help="file (mode 0600) holding the servers' API key (SGLang --api-key; sent as 'Authorization: Bearer'). "
        "Launched servers: null = a fresh random key per run in <output_dir>/.rollout_api_key; a path = that "
        "file's key, created with a fresh one when missing. With urls: the running servers' key (or api_key_env); "
        "null with no api_key_env = servers without a key. The key itself is never a config value",
    )
    api_key_env: str | None = setting(
        None,
        help="with urls: name of an environment variable holding the running servers' API key (instead of "
        "api_key_file)",
    )


@dataclass(frozen=True)
class RolloutConfig:
    """Generation: which engine, how many samples, how weights reach it."""

    engine: Literal["local", "sglang"] = setting(
        "local", help="local = embedded engine in the trainer process (small runs); sglang = SGLang servers"
    )
    n_samples: int = setting(8, help="responses per prompt (the group size G)", ge=1)
    prompts_per_step: int = setting(32, help="prompts per training step", ge=1)
    sampling: SamplingParams = setting(default_factory=SamplingParams, help="sampling parameters of generation")
    sglang: SGLangConfig = setting(default_factory=SGLangConfig, help="SGLang servers (engine=sglang only)")
    side_models: tuple[SideModel, ...] = setting(
        (),
        help="frozen models served by SGLang beside the rollout servers, never sent weights: [{name, hf_path, "
        "num_servers, tp, mem_fraction_static, urls}]; a judge's url or algo.distill.sglang_urls names one as "
        "side:<name> (config/side_models.py)",
    )
    weight_sync: Literal["tensor", "distributed", "disk"] = setting(
        "tensor",
        help="how new weights reach the engine: tensor = in memory (local engine, colocated servers), "
        "distributed = NCCL broadcast to separate servers, disk = via a checkpoint directory (fallback)",
    )
    bucket_mb: int = setting(512, help="weights are sent in buckets of at most this many MiB", ge=1)
    verify_sync: Literal["off", "first", "every"] = setting(
        "every",
        help="after a weight sync the engine scores a probe of the run's prompts (prefill only) and reports its "
        "weight version; a log-prob error beyond the per-dtype tolerance, or another version, stops the run. "
        "every = the first sync and every verify_sync_every-th after it; first = the first sync only",
    )
    verify_sync_every: int = setting(10, help="verify_sync=every: verify one sync in this many", ge=1)
    restarts_per_step: int = setting(
        2,
        help="a dead or hung rollout server is restarted, given the current weights and the step's rollout "
        "retried this many times before the run stops with the server's error",
        ge=0,
    )
    engine_process: Literal["auto", "trainer", "separate"] = setting(
        "auto",
        help="where the local engine runs: trainer = in the trainer's process (rank 0); separate = a child process "
        "of rank 0 that takes new weights through shared memory, so generation overlaps training in async mode; "
        "auto = separate in async mode, trainer otherwise",
    )
    engine_threads: int = setting(
        1,
        help="rollout.engine_process=separate: torch threads of the engine's process; on CPU they come out of the "
        "trainer's (it keeps the rest, at least one)",
        ge=1,
    )
    partial: bool = setting(
        False,
        help="async mode: at a weight update, generations in flight are interrupted and continued under the new "
        "weights from where they stopped (each token keeps the weight version and log-prob that produced it); "
        "false = the update waits until the requests in flight have finished",
    )
    env: str | None = setting(
        None,
        help="multi-turn rollouts: the environment that answers each model turn (a built-in name such as 'tools', "
        "or 'package.module:Class'); null = one response per prompt",
    )
    env_options: dict[str, Any] = setting(
        default_factory=dict,
        help="keyword options of the environment, e.g. {tools: [calculator], tool_call_format: hermes, "
        "tool_options: {python: {timeout_s: 5}}}; tools: max_calls_per_turn (8: later calls of a turn are answered "
        "with the cap, not run), tool_options.python.isolation (auto: bubblewrap + seccomp, refused at start-up "
        "when it cannot run; none: no kernel isolation, warned every step); docs/multi_turn.md, docs/security.md",
    )
    generate_fn: str | None = setting(
        None,
        help="full control over one rollout instead of env: 'package.module:function' called as "
        "generate(engine, prompt, params) -> Trajectory (slime's custom generate function)",
    )
    turns: TurnLimits = setting(default_factory=TurnLimits, help="multi-turn limits (env or generate_fn only)")
    release_memory: bool = setting(
        False,
        help="colocated runs: the rollout engine frees its weights and KV cache while the trainer trains, and "
        "takes them back for the weight sync and generation (SGLang: launched with --enable-memory-saver; "
        "/release_memory_occupation, CUDA only)",
    )
    lora_sync: Literal["merged", "adapter"] = setting(
        "merged",
        help="with model.lora: merged = the engine gets W + (alpha/rank) B A, after a start's first sync only the "
        "tensors the adapters touch (every tensor with release_memory or weight_sync=disk); adapter = SGLang serves "
        "the adapters itself (launched with --enable-lora): the base once, then only the adapters (attention "
        "targets, trainer.mode=sync, GPU)",
    )


@dataclass(frozen=True)
class TrainSource:
    """One training dataset of a mixture (`data.train: [{path, weight}, ...]`)."""

    path: str = setting(
        help="a JSONL / Parquet / .arrow file, a Hugging Face `datasets` folder (save_to_disk), or a built-in task"
    )
    weight: float = setting(1.0, help="share of the prompts drawn from this dataset (normalised over the list)", gt=0)


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a weighted sum (`data.reward: [{name, weight, options}, ...]`)."""

    name: str = setting(help="a built-in reward name (`megatron-rl rewards`) or an import path 'package.module:fn'")
    weight: float = setting(1.0, help="its weight in the sample's reward (the sum over the list)")
    options: dict[str, Any] = setting(
        default_factory=dict, help="keyword options passed to the reward function on every call"
    )


@dataclass(frozen=True)
class EvalSet:
    """One evaluation dataset (`data.eval: [{name, path, ...}, ...]`), scored every `data.eval_every` steps with
    its own sampling settings; its metrics are logged as `eval/<name>/<metric>`."""

    name: str = setting(help="the dataset's name in the metric keys (eval/<name>/mean@4) and eval_samples.jsonl")
    path: str = setting(
        help="a JSONL / Parquet / .arrow file, a Hugging Face `datasets` folder (save_to_disk), or a built-in task"
    )
    reward: str | tuple[RewardSpec, ...] | None = setting(
        None, help="its reward (a name, an import path, or a list of {name, weight, options}); null = data.reward"
    )
    n_samples: int = setting(
        1, help="responses per prompt (k of mean@k); above 1 needs a temperature above 0", ge=1
    )
    temperature: float = setting(0.0, help="sampling temperature; 0 = greedy (then `accuracy` is logged)", ge=0)
    top_p: float = setting(1.0, help="nucleus sampling mass", gt=0, le=1)
    max_new_tokens: int | None = setting(None, help="response length cap; null = rollout.sampling.max_new_tokens")
    prompts: int | None = setting(None, help="the first N prompts of the dataset; null = data.eval_prompts")
    pass_k: tuple[int, ...] | None = setting(
        None, help="the k of pass@k and maj@k, each <= n_samples; null = the powers of 2 up to n_samples, and n_samples"
    )
    prompt_key: str | None = setting(None, help="column holding the prompt; null = data.prompt_key")
    answer_key: str | None = setting(None, help="column holding the reference answer; null = data.answer_key")


@dataclass(frozen=True)
class DataConfig:
    """Prompts, answers and the reward."""

    train: str | tuple[TrainSource, ...] = setting(
        "synthetic",
        help="training prompts: a JSONL / Parquet / .arrow file or a `datasets` folder, a list of {path, weight} "
        "(a mixture), or a built-in task: 'synthetic' (reverse digits, the demo) or 'synthetic_tool' "
        "(multiplication with a calculator tool; rollout.env: tools)",
    )
    eval: str | tuple[EvalSet, ...] | None = setting(
        None,
        help="evaluation data: a file or folder as in data.train or a built-in task (greedy, data.eval_prompts "
        "prompts, logged as eval/accuracy), or a list of datasets {name, path, reward, n_samples, temperature, "
        "top_p, max_new_tokens, prompts, pass_k, prompt_key, answer_key} (mean@k, pass@k, maj@k per dataset as "
        "eval/<name>/<metric>); null = no evaluation",
    )
    prompt_key: str = setting(
        "prompt",
        help="column holding the prompt: text or chat messages [{role, content}]; dotted for nested columns "
        "(docs/datasets.md lists verl's, slime's, TRL's and the math datasets' layouts)",
    )
    answer_key: str | None = setting(
        "answer",
        help="column holding the reference answer passed to the reward as metadata['answer'] (text; lists and "
        "dicts as JSON); dotted for nested columns, e.g. reward_model.ground_truth (verl); null = the rows have no "
        "answer (e.g. TRL's prompt-only data with a reward that needs none)",
    )
    apply_chat_template: bool = setting(True, help="wrap prompts with the tokenizer's chat template")
    reward: str | tuple[RewardSpec, ...] = setting(
        "exact_match",
        help="reward function: a built-in name (`megatron-rl rewards` lists them), an import path "
        "'package.module:function', or a list of {name, weight, options} summed with their weights (each logged "
        "as reward/<name>)",
    )
    reward_timeout_s: float = setting(10.0, help="seconds one reward call may take before it scores 0", gt=0)
    reward_failure_limit: float = setting(
        0.1,
        help="stop the run when more than this share of a step's (or an evaluation's) reward calls raise, time out "
        "or return a non-number; the error names the function, the first error and its sample",
        ge=0,
        le=1,
    )
    eval_every: int = setting(0, help="evaluate every N steps and after the last one; 0 = never", ge=0)
    eval_prompts: int = setting(64, help="prompts per evaluation", ge=1)

    def train_sources(self) -> tuple[TrainSource, ...]:
        """`train` as a list of {path, weight} (one dataset: weight 1)."""
        return (TrainSource(self.train),) if isinstance(self.train, str) else self.train

    def reward_specs(self) -> tuple[RewardSpec, ...]:
        """`reward` as a list of {name, weight, options} (one name: weight 1, no options)."""
        return (RewardSpec(self.reward),) if isinstance(self.reward, str) else self.reward

    def eval_sets(self) -> tuple[EvalSet, ...]:
        """`eval` as a list of datasets; the one-dataset form is one greedy set of `eval_prompts` prompts named
        after its file (or built-in task), with the run's reward and keys. None: no evaluation."""
        if self.eval is None:
            return ()
        if isinstance(self.eval, str):
            return (EvalSet(name=eval_set_name(self.eval), path=self.eval, prompts=self.eval_prompts),)
        return self.eval

    def eval_columns(self, spec: EvalSet) -> tuple[str, str | None]:
        """The prompt and answer columns of evaluation dataset `spec`: its own, else data.prompt_key / answer_key."""
        return spec.prompt_key or self.prompt_key, spec.answer_key if spec.answer_key is not None else self.answer_key

    def eval_is_list(self) -> bool:
        """Whether `eval` is the list form (metrics keyed eval/<name>/...; the one-dataset form keeps eval/...)."""
        return isinstance(self.eval, tuple)


def eval_set_name(path: str) -> str:
    """The name of a one-dataset `data.eval`: a built-in task's name, else the file's (folder's) stem."""
    return Path(path.rstrip("/")).stem or path


@dataclass(frozen=True)
class WarmupConfig:
    """Optional supervised warm-up (SFT) before RL, on a built-in task or the user's data; `megatron-rl sft` runs
    it alone."""

    sft_steps: int = setting(0, help="supervised steps before RL; 0 = no warm-up", ge=0)
    sft_lr: float = setting(1e-4, help="learning rate of the warm-up", gt=0)
    sft_batch_size: int = setting(16, help="prompt-answer pairs per warm-up step", ge=1)
    data: str | None = setting(
        None,
        help="SFT data (a file or folder as in data.train, or a built-in task); null = data.train. A row is a "
        "prompt (warmup.prompt_key) with a response (warmup.response_key), or chat messages ending in an "
        "assistant turn (every assistant turn trains)",
    )
    prompt_key: str | None = setting(None, help="column of the SFT prompt or chat messages; null = data.prompt_key")
    response_key: str = setting(
        "response", help="column of the SFT target response (unused for rows of chat messages); dotted for nested"
    )
    save_every: int = setting(
        100,
        help="checkpoint the warm-up every N SFT steps (a crashed or stopped run resumes mid-SFT there); 0 = never",
        ge=0,
    )


@dataclass(frozen=True)
class TrainerConfig:
    """The training loop: length, batching, checkpoints."""

    steps: int = setting(100, help="RL steps (generate, score, update, sync weights)", ge=1)
    micro_batch_tokens: int = setting(
        4096, help="token budget of one forward/backward micro-batch (sequences are packed up to it)", ge=1
    )
    balance_quadratic: float = setting(
        0.0,
        help="balancing data-parallel ranks and micro-batches: a sample costs tokens + this x tokens^2 (weigh the "
        "attention's quadratic work; 0 = balance tokens)",
        ge=0,
    )
    seed: int = setting(1234, help="seed of data order, sampling and dropout")
    cpu_threads: int = setting(
        0,
        help="torch's intra-op threads of a trainer process on CPU; 0 = torch's default (one per core). Tiny models "
        "step faster on one thread (the demo: 1.43x) than on two",
        ge=0,
    )
    mode: Literal["sync", "async"] = setting(
        "sync",
        help="sync = each step generates, then trains on what it generated; async = a rollout producer generates "
        "the next steps' samples while the trainer trains, with weights at most trainer.max_staleness versions "
        "behind (slime's train_async, verl's one-step off-policy)",
    )
    max_staleness: int = setting(
        1,
        help="async mode: the most weight versions a trained sample may lag the trainer (1 = one-step off-policy; "
        "0 = the async machinery with sync results). The producer starts the batch of step t only on weights of "
        "version t-1-max_staleness or newer, so no sample is staler; each is checked",
        ge=0,
    )
    colocate: bool = setting(
        True, help="trainer and rollout engine share the GPUs and take turns; false = separate GPUs"
    )
    offload_actor: bool = setting(
        False,
        help="colocated runs: move the actor's weights, gradient buffers and optimizer state to host memory "
        "while the rollout engine generates, and back before training (frees the GPU for the KV cache)",
    )
    output_dir: str = setting("runs/megatron_rl", help="checkpoints, the resolved config, logs and plots go here")
    save_every: int = setting(
        50,
        help="save a checkpoint every N steps (and after the last); 0 = only the last (the warm-up's: "
        "warmup.save_every)",
        ge=0,
    )
    keep_last: int = setting(2, help="checkpoints to keep; 0 = keep all", ge=0)
    async_save: bool = setting(
        False,
        help="write checkpoints in the background (Megatron's async dist_checkpointing save) while training goes "
        "on; a checkpoint is published (COMPLETE, latest) when its write has finished, at the next save or the "
        "end of the run, and a save waits for the previous one",
    )
    resume: str = setting(
        "auto",
        help="auto = continue the run in output_dir from its latest complete checkpoint (refused if output_dir "
        "holds a run with another config); never = a fresh run (refused if output_dir holds another run's "
        "checkpoints or metrics); or a checkpoint path (continues even if the config changed)",
    )
    overwrite: bool = setting(
        False,
        help="start a fresh run even if output_dir holds another run: the old folder is renamed to "
        "<output_dir>.old-<time> (never deleted)",
    )
    save_on_interrupt: bool = setting(
        True,
        help="Ctrl-C / SIGTERM stops at the end of the current step; true = save a checkpoint there first "
        "(a second Ctrl-C aborts at once)",
    )
    on_nonfinite: Literal["stop", "skip"] = setting(
        "stop",
        help="a NaN/inf loss or gradient: stop = raise an error naming the step and micro-batch before the update "
        "touches the weights; skip = drop that update (no optimizer step), count it in actor/nonfinite_skipped and "
        "go on",
    )
    stop_on: dict[str, Any] | None = setting(
        None,
        help="stop the run when a logged fidelity metric leaves its healthy range: {metric: threshold} for "
        "mismatch/k3_kl, mismatch/logp_abs_diff_max, actor/grad_norm (above = stop) and routing/agreement (below "
        "= stop), or {metric: {threshold: N, action: skip}} to drop and count (actor/grad_norm_skipped) the "
        "updates whose grad norm is above N; null = the defaults measured on fp32 (mismatch and route agreement "
        "with the local engine in sync mode only; none for bf16: docs/reliability.md), {} = off. NaN/inf stay "
        "with on_nonfinite",
    )


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics: wandb, TensorBoard, console, plots."""

    wandb: bool = setting(True, help="log to Weights & Biases")
    wandb_project: str = setting("megatron-rl", help="wandb project")
    wandb_run_name: str | None = setting(None, help="wandb run name; null = the name of trainer.output_dir")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = setting(
        "auto", help="auto = online if WANDB_API_KEY is set, else offline (sync later with `wandb sync`)"
    )
    tensorboard: bool = setting(False, help="also write TensorBoard event files to output_dir/tensorboard")
    log_every: int = setting(1, help="print and log metrics every N steps", ge=1)
    plot: bool = setting(True, help="write PNG plots of the main metrics to output_dir at the end")
    samples_every: int = setting(
        1, help="write logging.samples_per_step rollout samples to output_dir/samples.jsonl every N steps; 0 = never",
        ge=0,
    )
    samples_per_step: int = setting(8, help="rows per step in samples.jsonl (and the wandb samples table)", ge=1)
    show_samples: int = setting(0, help="print this many of the step's samples (prompt, response, reward)", ge=0)

    def resolved_wandb_mode(self, environ: Mapping[str, str] | None = None) -> Literal["online", "offline", "disabled"]:
        """The mode to pass to ``wandb.init``: ``auto`` resolved against WANDB_API_KEY, ``disabled`` if off."""
        if not self.wandb:
            return "disabled"
        if self.wandb_mode != "auto":
            return self.wandb_mode
        env = os.environ if environ is None else environ
        return "online" if env.get("WANDB_API_KEY") else "offline"


@dataclass(frozen=True)
class RLConfig:
    """Everything a `megatron-rl train` run reads; saved resolved as output_dir/config.yaml."""

    model: ModelConfig = setting(help="the policy model")
    parallel: ParallelLayout = setting(
        default_factory=ParallelLayout, help="Megatron parallel layout of the actor (and reference) model"
    )
    optimizer: OptimizerOptions = setting(default_factory=OptimizerOptions, help="optimizer and LR schedule")
    algo: AlgoConfig = setting(default_factory=AlgoConfig, help="the RL algorithm")
    rollout: RolloutConfig = setting(default_factory=RolloutConfig, help="generation")
    data: DataConfig = setting(default_factory=DataConfig, help="prompts and reward")
    warmup: WarmupConfig = setting(default_factory=WarmupConfig, help="optional supervised warm-up")
    trainer: TrainerConfig = setting(default_factory=TrainerConfig, help="training loop and checkpoints")
    logging: LoggingConfig = setting(default_factory=LoggingConfig, help="metrics and plots")
    plugins: tuple[str, ...] = setting(
        (),
        help="Python modules imported at start-up, before the config is validated, so the rewards, environments "
        "and tools they register can be named (modules next to the config file and in the working directory are "
        "found without PYTHONPATH)",
    )
