"""Checks that involve more than one field, run when a config is loaded: fail at start-up, not at step 5000.

Single-field checks (types, bounds, registry names) happen when values are read (``coercion.py``);
world-size and model-shape rules of the parallel layout belong to ``ParallelLayout.validate``, which
the trainer calls once it knows the world size and the model.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS
from megatron_rl.algorithms.gae import ADVANTAGE as GAE
from megatron_rl.config.algo import check_critic
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.options import check_lora_sync
from megatron_rl.config.schema import EvalSet, RewardSpec, RLConfig
from megatron_rl.config.side_models import check_side_models
from megatron_rl.config.stop_on import stop_rules
from megatron_rl.kernels import packed_gspo_applies
from megatron_rl.models.architecture import is_moe
from megatron_rl.models.hf_config import read_hf_config_if_present

# Engines that can return the experts each token was routed to (needed by R3).
ENGINES_WITH_ROUTED_EXPERTS = ("local", "sglang")
_REWARD = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?$")


def validate(cfg: RLConfig) -> list[str]:
    """Raise ConfigError listing every invalid combination in ``cfg``; return notes worth a warning."""
    errors: list[str] = []
    notes: list[str] = []
    checks = (_check_algo, _check_routing_replay, _check_rollout, _check_data, _check_trainer, _check_stop_on)
    for check in (*checks, _check_optimizer, _check_lora, check_critic, check_lora_sync):
        check(cfg, errors, notes)
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
    return notes


def check_input_paths(cfg: RLConfig) -> None:
    """Raise ConfigError for each input path of ``cfg`` that does not exist: before anything is built.

    Separate from `validate`: a config may name paths of another machine (``megatron-rl launch`` plans a
    cluster job from a login node); the run itself checks them here, on the machine that reads them.
    """
    errors: list[str] = []
    model = cfg.model
    hf_path = Path(model.hf_path)
    if not model.build_tiny_if_missing:
        if not hf_path.exists():
            errors.append(
                f"model.hf_path={model.hf_path!r} does not exist: point it at a Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer), or set model.build_tiny_if_missing=true to build the tiny "
                "demo model there"
            )
        elif not (hf_path / "config.json").is_file():
            errors.append(
                f"model.hf_path={model.hf_path!r} has no config.json: it must be a Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer)"
            )
    teacher = cfg.algo.distill.teacher
    if teacher is not None and not (Path(teacher) / "config.json").is_file():
        errors.append(
            f"algo.distill.teacher={teacher!r} is not a Hugging Face model directory (no config.json): point it at "
            "the teacher's checkpoint, or set it to null to train without distillation"
        )
    tokenizer = model.tokenizer_path
    if tokenizer is not None and tokenizer != model.hf_path and not Path(tokenizer).is_dir():
        errors.append(
            f"model.tokenizer_path={tokenizer!r} is not a directory: set it to the tokenizer's directory "
            "(tokenizer.json, tokenizer_config.json) or to null to use model.hf_path's"
        )
    from megatron_rl.config.tasks import SYNTHETIC_TASKS

    inputs: list[tuple[str, str | None]] = [("data.train", s.path) for s in cfg.data.train_sources()]
    listed = cfg.data.eval_is_list()
    inputs += [(f"data.eval[{i}].path" if listed else "data.eval", e.path) for i, e in enumerate(cfg.data.eval_sets())]
    inputs.append(("warmup.data", cfg.warmup.data))
    from megatron_rl.data.readers import DataFileError, data_files

    for key, value in inputs:
        if value is None or value in SYNTHETIC_TASKS:
            continue
        if not Path(value).exists():
            errors.append(
                f"{key}={value!r}: no such file or folder; give a JSONL / Parquet / .arrow file or a `datasets` "
                f"folder, or a built-in task ({', '.join(repr(t) for t in SYNTHETIC_TASKS)})"
            )
            continue
        try:
            data_files(value)  # a known format; a folder of one split (its listing and state.json only)
        except DataFileError as err:
            errors.append(f"{key}: {err}")
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def _check_algo(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    algo, rollout = cfg.algo, cfg.rollout
    max_new = rollout.sampling.max_new_tokens
    if algo.agg == "seq-mean-token-sum-norm" and algo.agg_norm is None:
        errors.append(
            "algo.agg='seq-mean-token-sum-norm' needs algo.agg_norm, a constant normaliser (Dr. GRPO: the "
            f"generation cap, here algo.agg_norm={max_new}); without it each batch is divided by its padded "
            "length, so the loss scale depends on padding"
        )
    if algo.agg_norm is not None and algo.agg != "seq-mean-token-sum-norm":
        notes.append(f"algo.agg_norm={algo.agg_norm} is unused with algo.agg={algo.agg!r}")
    if algo.clip_c is not None and algo.loss != "ppo":
        errors.append(
            f"algo.clip_c (dual clip) applies to algo.loss='ppo' only, not {algo.loss!r}; set algo.clip_c=null"
        )
    if algo.gspo_kernel in ("torch", "triton") and not packed_gspo_applies(algo.loss, algo.agg):
        errors.append(
            f"algo.gspo_kernel={algo.gspo_kernel!r} computes loss=gspo/gspo_token with agg='seq-mean-token-mean' "
            f"only, not loss={algo.loss!r} with agg={algo.agg!r}; set algo.gspo_kernel=auto or reference"
        )
    grouped = algo.advantage != GAE  # the critic's GAE needs no group
    if rollout.n_samples < 2 and grouped:
        errors.append(
            f"rollout.n_samples={rollout.n_samples}: algo.advantage={algo.advantage!r} is group-relative, so a "
            "group of one response has advantage 0 and nothing is learned; use rollout.n_samples >= 2 (or gae)"
        )
    if rollout.n_samples < 2 and algo.dynamic_sampling:
        errors.append("algo.dynamic_sampling needs rollout.n_samples > 1: a group of one is always 'all equal'")
    estimator = ADVANTAGE_ESTIMATORS.get(algo.advantage) if grouped else None
    takes_std_option = estimator is None or "norm_by_std" in inspect.signature(estimator).parameters
    if not algo.norm_adv_by_std and not takes_std_option and algo.advantage != "dr_grpo":
        errors.append(
            f"algo.norm_adv_by_std=false has no effect with algo.advantage={algo.advantage!r} (only 'grpo' "
            "divides by the group std); use algo.advantage=grpo or dr_grpo"
        )
    multi_turn = rollout.env is not None or rollout.generate_fn is not None
    if rollout.env is not None and rollout.generate_fn is not None:
        errors.append(
            f"rollout.env={rollout.env!r} and rollout.generate_fn={rollout.generate_fn!r} are both set: a custom "
            "generate function replaces the environment loop; set one of them to null"
        )
    if multi_turn and algo.overlong_buffer >= rollout.turns.max_tokens:
        errors.append(
            f"algo.overlong_buffer={algo.overlong_buffer} must be < rollout.turns.max_tokens="
            f"{rollout.turns.max_tokens}: multi-turn trajectories are penalised on their whole length"
        )
    elif not multi_turn and algo.overlong_buffer >= max_new:
        errors.append(
            f"algo.overlong_buffer={algo.overlong_buffer} must be < rollout.sampling.max_new_tokens={max_new}: "
            "the overlong penalty ramps over the last overlong_buffer tokens of the generation cap"
        )
    samples = rollout.prompts_per_step * rollout.n_samples
    if samples % algo.mini_batches_per_step:
        errors.append(
            f"rollout.prompts_per_step * rollout.n_samples = {rollout.prompts_per_step} * {rollout.n_samples} = "
            f"{samples} samples per step do not split into algo.mini_batches_per_step={algo.mini_batches_per_step} "
            "equal mini-batches"
        )
    if algo.rollout_correction == "icepop" and algo.rollout_correction_low > algo.rollout_correction_high:
        errors.append(
            f"algo.rollout_correction_low={algo.rollout_correction_low} > algo.rollout_correction_high="
            f"{algo.rollout_correction_high}: icepop keeps weights in [low, high]"
        )
    distill = algo.distill
    if distill.teacher is not None and not distill.task_rewards and algo.dynamic_sampling:
        errors.append(
            "algo.dynamic_sampling drops groups by their task rewards, which algo.distill.task_rewards=false leaves "
            "out of the advantage: set algo.dynamic_sampling=false"
        )
    if distill.teacher is not None and distill.coef == 0 and (distill.top_k == 0 or distill.top_k_coef == 0):
        errors.append(
            "algo.distill.coef=0 without a top-k term (algo.distill.top_k and top_k_coef > 0) leaves the teacher "
            "unused: set coef > 0, or top_k > 0"
        )
    if distill.teacher is not None and distill.served_by == "megatron":
        notes.append(
            f"algo.distill.teacher={distill.teacher}: scores each step's tokens in the actor's parallel layout: with "
            "the student's architecture its weights are kept on the host and swapped into the actor (as the KL "
            "reference is), else it is a second model resident on the GPUs"
        )
    if algo.kl_coef > 0:
        notes.append(
            f"algo.kl_coef={algo.kl_coef}: a reference model (same layout as the actor) is kept for the "
            f"{algo.kl_estimator} KL term"
        )
    if algo.loss in ("gspo", "gspo_token") and max(algo.clip_low, algo.clip_high) >= 0.01:
        notes.append(
            f"algo.loss={algo.loss!r} clips the sequence-level ratio, which stays within ~1e-3 of 1: clip range "
            f"{algo.clip_low}/{algo.clip_high} almost never clips (GSPO uses 3e-4/4e-4)"
        )
    if algo.loss == "cispo" and algo.clip_low < 1:
        notes.append(
            f"algo.clip_low={algo.clip_low} bounds the CISPO weight below at {1 - algo.clip_low:g}; the paper "
            "sets no lower bound (clip_low >= 1)"
        )


def _check_lora(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    lora = cfg.model.lora
    problems = {
        f"rank={lora.rank} must be >= 0 (0 = no adapters)": lora.rank < 0,
        f"alpha={lora.alpha} must be > 0: the update is (alpha / rank) * B A": lora.rank > 0 and lora.alpha <= 0,
        f"dropout={lora.dropout}: only 0 is supported (dropout makes the training forward differ from the scoring "
        "forward: ppo_kl_first != 0)": lora.rank > 0 and lora.dropout != 0,
        "targets is empty: name attention, mlp, shared_experts and/or experts": lora.rank > 0 and not lora.targets,
        "adapts the local spec's layers: set model.options.layer_spec=local or auto": lora.rank > 0
        and cfg.model.options.layer_spec == "te",
    }
    errors += [f"model.lora.{problem}" for problem, bad in problems.items() if bad]
    if lora.rank > 0:
        notes.append(f"model.lora.rank={lora.rank}: only adapters on {', '.join(lora.targets)} train (base frozen)")


def _check_routing_replay(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    mode, engine = cfg.algo.routing_replay, cfg.rollout.engine
    hf = read_hf_config_if_present(cfg.model.hf_path)
    moe = hf is not None and is_moe(hf)
    if mode == "off":
        if moe and cfg.algo.loss == "ppo":
            notes.append(
                "token-level ppo loss on a MoE model without routing replay: the experts a token uses change "
                "between the old-policy and training passes, which the GSPO paper (Fig. 3) found stalls GRPO; "
                "consider algo.routing_replay=R2 or R3"
            )
        return
    if not cfg.model.options.routing_replay:
        errors.append(
            f"algo.routing_replay={mode} needs routers built for replay: set model.options.routing_replay=true"
        )
    if hf is not None and not moe:
        errors.append(f"algo.routing_replay={mode} needs a MoE model, but {cfg.model.hf_path} has no experts")
    if mode == "R3":
        if engine not in ENGINES_WITH_ROUTED_EXPERTS:
            errors.append(
                f"algo.routing_replay=R3 replays the rollout engine's routes, but rollout.engine={engine!r} does "
                f"not return them; use one of {', '.join(ENGINES_WITH_ROUTED_EXPERTS)}"
            )
        if engine == "sglang" and cfg.rollout.sglang.urls:
            notes.append(
                "algo.routing_replay=R3: the servers in rollout.sglang.urls must run with "
                "--enable-return-routed-experts"
            )


def _check_rollout(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    rollout, colocate = cfg.rollout, cfg.trainer.colocate
    check_side_models(cfg, errors)
    s = rollout.sampling
    if s.max_new_tokens < 1:
        errors.append(f"rollout.sampling.max_new_tokens={s.max_new_tokens} must be >= 1")
    if s.temperature < 0:
        errors.append(f"rollout.sampling.temperature={s.temperature} must be >= 0 (0 = greedy)")
    if not 0 < s.top_p <= 1:
        errors.append(f"rollout.sampling.top_p={s.top_p} must be in (0, 1]")
    if s.top_k != -1 and s.top_k < 1:
        errors.append(f"rollout.sampling.top_k={s.top_k} must be -1 (all tokens) or >= 1")
    if any(t < 0 for t in s.stop_token_ids):
        errors.append(f"rollout.sampling.stop_token_ids={list(s.stop_token_ids)} must be token ids >= 0")
    if not colocate and (rollout.release_memory or cfg.trainer.offload_actor):
        errors.append(
            "rollout.release_memory and trainer.offload_actor free memory for a colocated partner: with "
            "trainer.colocate=false the engine and the trainer have their own GPUs; set them to false"
        )
    if rollout.release_memory and rollout.engine == "sglang" and rollout.sglang.urls:
        notes.append(
            "rollout.release_memory with connected servers (rollout.sglang.urls): they must have been launched "
            "with --enable-memory-saver"
        )
    if rollout.engine == "local":
        if rollout.weight_sync != "tensor":
            errors.append(
                f"rollout.weight_sync={rollout.weight_sync!r}: the local engine runs in the trainer process and "
                "takes weights in memory; use rollout.weight_sync=tensor"
            )
        if not colocate:
            errors.append("rollout.engine='local' runs inside the trainer process: trainer.colocate must be true")
        return
    if rollout.weight_sync == "distributed" and colocate:
        errors.append(
            "rollout.weight_sync='distributed' broadcasts over an NCCL group of trainer and servers, which cannot "
            "hold two ranks on one GPU; with trainer.colocate=true use rollout.weight_sync=tensor"
        )
    if rollout.weight_sync == "tensor" and not colocate:
        notes.append(
            "rollout.weight_sync='tensor' with separate GPUs (trainer.colocate=false) sends weights by value over "
            "HTTP; 'distributed' (NCCL broadcast) is the fast path"
        )
    sg = rollout.sglang
    if sg.urls and sg.num_servers > 1:
        errors.append(
            f"rollout.sglang.urls lists running servers and rollout.sglang.num_servers={sg.num_servers} asks to "
            "launch servers; set only one of them"
        )
    bad_urls = [u for u in sg.urls if not re.match(r"^https?://[^/\s]+", u)]
    if bad_urls:
        errors.append(f"rollout.sglang.urls: {bad_urls} are not http(s)://host:port addresses")
    if not sg.urls and sg.router and sg.base_port <= sg.router_port < sg.base_port + sg.num_servers:
        errors.append(
            f"rollout.sglang.router_port={sg.router_port} collides with the server ports {sg.base_port}.."
            f"{sg.base_port + sg.num_servers - 1}"
        )


def _check_data(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    data = cfg.data
    if data.eval_every > 0 and data.eval is None:
        errors.append(
            f"data.eval_every={data.eval_every} but data.eval is null: set data.eval (a data file or folder, or a "
            "built-in task)"
        )
    if data.eval is not None and data.eval_every == 0:
        errors.append(f"data.eval={data.eval!r} is never used with data.eval_every=0; set data.eval_every > 0")
    from megatron_rl.config.tasks import SYNTHETIC_TASKS

    sources = data.train_sources()
    if len(sources) > 1 and any(s.path in SYNTHETIC_TASKS for s in sources):
        errors.append(
            "data.train mixes a built-in task with data files: a built-in task trains alone (e.g. "
            "data.train=synthetic); list only files in a mixture"
        )
    for spec in data.reward_specs():
        if not _REWARD.match(spec.name):
            errors.append(
                f"data.reward={spec.name!r} is neither a reward name nor an import path 'package.module:function'"
            )
    if data.eval_is_list():
        _check_eval_sets(data.eval_sets(), errors)


_EVAL_NAME = re.compile(r"^[A-Za-z0-9_.@-]+$")


def _check_eval_sets(sets: tuple[EvalSet, ...], errors: list[str]) -> None:
    """The list form of data.eval: unique names usable in metric keys, sampling that can give n different
    responses, pass_k within n."""
    if not sets:
        errors.append("data.eval is an empty list: list at least one dataset {name, path}, or set data.eval=null")
    seen: set[str] = set()
    for i, e in enumerate(sets):
        key = f"data.eval[{i}]"
        if not _EVAL_NAME.match(e.name):
            errors.append(f"{key}.name={e.name!r}: use letters, digits and _ . - @ (it becomes eval/<name>/<metric>)")
        if e.name in seen:
            errors.append(f"{key}.name={e.name!r} is used twice: give each evaluation dataset its own name")
        seen.add(e.name)
        if e.n_samples > 1 and e.temperature == 0:
            errors.append(
                f"{key} ({e.name}): n_samples={e.n_samples} at temperature 0 gives {e.n_samples} copies of the greedy "
                "response; set a temperature above 0 (e.g. 0.6 or 1.0) or n_samples=1"
            )
        for k in e.pass_k or ():
            if not 1 <= k <= e.n_samples:
                errors.append(
                    f"{key} ({e.name}): pass_k has k={k} but n_samples={e.n_samples}; pass@k needs 1 <= k <= n: "
                    f"lower the k or raise n_samples"
                )
        if e.prompts is not None and e.prompts < 1:
            errors.append(f"{key} ({e.name}): prompts={e.prompts}; evaluate at least 1 (null = data.eval_prompts)")
        if e.max_new_tokens is not None and e.max_new_tokens < 1:
            errors.append(f"{key} ({e.name}): max_new_tokens={e.max_new_tokens} must be >= 1 (null = the rollout's)")
        for spec in (RewardSpec(e.reward),) if isinstance(e.reward, str) else e.reward or ():
            if not _REWARD.match(spec.name):
                errors.append(
                    f"{key}.reward={spec.name!r} is neither a reward name nor an import path 'package.module:function'"
                )


def _check_trainer(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    trainer, max_new = cfg.trainer, cfg.rollout.sampling.max_new_tokens
    if trainer.micro_batch_tokens < max_new:
        errors.append(
            f"trainer.micro_batch_tokens={trainer.micro_batch_tokens} is below rollout.sampling.max_new_tokens="
            f"{max_new}: a micro-batch must hold at least one whole sequence (prompt + response)"
        )
    if trainer.resume not in ("auto", "never") and not Path(trainer.resume).exists():
        errors.append(f"trainer.resume={trainer.resume!r}: no such checkpoint (or use 'auto' / 'never')")
    if trainer.mode == "async":
        shared = {"trainer.offload_actor": trainer.offload_actor, "rollout.release_memory": cfg.rollout.release_memory}
        for key, on in shared.items():
            if on:
                errors.append(
                    f"{key}=true with trainer.mode=async: the engine generates while the trainer trains, so they "
                    f"cannot take turns with the memory; set {key}=false (or trainer.mode=sync)"
                )
    elif cfg.rollout.partial:
        errors.append(
            "rollout.partial=true needs trainer.mode=async: only async mode updates weights while requests are in "
            "flight"
        )


def _check_stop_on(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    rules, problems = stop_rules(cfg)
    errors.extend(problems)
    algo = cfg.algo
    if any(r.metric == "routing/agreement" for r in rules) and (
        algo.routing_replay == "off" or algo.replay_agreement_every == 0
    ):
        errors.append(
            "trainer.stop_on['routing/agreement'] reads a metric logged only with routing replay: set "
            "algo.routing_replay=R2 or R3 and algo.replay_agreement_every >= 1, or remove the threshold"
        )


def _check_optimizer(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    opt = cfg.optimizer
    if not opt.lr > 0:
        errors.append(f"optimizer.lr={opt.lr} must be > 0")
    if not 0 <= opt.min_lr <= opt.lr:
        errors.append(f"optimizer.min_lr={opt.min_lr} must be in [0, optimizer.lr={opt.lr}]")
    if opt.total_steps < 1 or opt.warmup_steps < 0:
        errors.append(f"optimizer.total_steps={opt.total_steps} must be >= 1 and warmup_steps >= 0")
    elif opt.warmup_steps > opt.total_steps:
        errors.append(f"optimizer.warmup_steps={opt.warmup_steps} exceeds optimizer.total_steps={opt.total_steps}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(opt, name) < 1:
            errors.append(f"optimizer.{name}={getattr(opt, name)} must be in [0, 1)")
    if not opt.adam_eps > 0:
        errors.append(f"optimizer.adam_eps={opt.adam_eps} must be > 0")
    for name in ("weight_decay", "clip_grad"):
        if getattr(opt, name) < 0:
            errors.append(f"optimizer.{name}={getattr(opt, name)} must be >= 0")
    if cfg.model.options.aux_loss_coeff < 0:
        errors.append(f"model.options.aux_loss_coeff={cfg.model.options.aux_loss_coeff} must be >= 0")
    if cfg.model.options.expert_bias_update_rate < 0:
        errors.append(f"model.options.expert_bias_update_rate={cfg.model.options.expert_bias_update_rate} must be >= 0")
    _check_optimizer_memory(cfg, errors, notes)
    updates = cfg.trainer.steps * cfg.algo.ppo_epochs * cfg.algo.mini_batches_per_step
    if opt.lr_schedule != "constant" and opt.total_steps != updates:
        notes.append(
            f"optimizer.total_steps={opt.total_steps} counts optimizer updates; this run makes trainer.steps * "
            f"algo.ppo_epochs * algo.mini_batches_per_step = {updates}, so the {opt.lr_schedule} decay "
            + ("does not finish" if opt.total_steps > updates else "ends early")
        )


def _check_optimizer_memory(cfg: RLConfig, errors: list[str], notes: list[str]) -> None:
    """CPU offload and the precision-aware optimizer: the combinations Megatron-Core (0.16 and 0.19) can run.

    Found in its code: `OptimizerConfig.__post_init__` asserts the distributed optimizer and fp32 dtypes without
    the precision-aware optimizer; the `HybridDeviceOptimizer` steps torch's AdamW on fp32 host copies
    (`param_update_in_fp32`) and cannot take an fp32 model's parameter shards (views of the parameters: torch
    refuses a non-leaf tensor); without the precision-aware optimizer the distributed optimizer keeps its fp32
    main shards on the GPU and `reload_model_params` does not refresh their host copies after the weights are
    loaded. Transformer Engine and CUDA are checked where the optimizer is built (`training_setup`): a config
    may be planned on a machine without them."""
    opt, dtype = cfg.optimizer, cfg.model.options.dtype
    if opt.cpu_offload:
        if not opt.distributed_optimizer:
            errors.append(
                "optimizer.cpu_offload=true offloads the distributed optimizer's shards: set "
                "optimizer.distributed_optimizer=true"
            )
        if not opt.precision_aware:
            errors.append(
                "optimizer.cpu_offload=true needs optimizer.precision_aware=true: without it the fp32 main parameters "
                "stay on the GPU as well, and Megatron-Core's hybrid optimizer does not refresh their host copies when "
                "the weights are loaded"
            )
        if not 0 < opt.offload_fraction <= 1:
            errors.append(
                f"optimizer.offload_fraction={opt.offload_fraction} must be in (0, 1]: the share of the optimizer "
                "state kept in host memory"
            )
        for key in ("main_params_dtype", "moments_dtype"):
            if getattr(opt, key) != "fp32":
                errors.append(
                    f"optimizer.{key}={getattr(opt, key)!r} with optimizer.cpu_offload=true: the host optimizer "
                    "(torch AdamW in Megatron's HybridDeviceOptimizer) keeps fp32 main parameters and moments; "
                    f"set optimizer.{key}=fp32"
                )
    elif opt.offload_fraction != 1.0 or not opt.overlap_offload_transfers:
        notes.append(
            "optimizer.offload_fraction and optimizer.overlap_offload_transfers apply with optimizer.cpu_offload=true "
            "only"
        )
    if opt.precision_aware:
        if not opt.distributed_optimizer:
            errors.append(
                "optimizer.precision_aware=true needs optimizer.distributed_optimizer=true (Megatron-Core supports "
                "the precision-aware optimizer only inside the distributed optimizer)"
            )
        if dtype != "bf16":
            errors.append(
                f"optimizer.precision_aware=true with model.options.dtype={dtype!r}: it keeps lower-precision "
                "optimizer copies of bf16 weights; with fp32 weights the parameters are their own main copy. Set "
                "model.options.dtype=bf16 or optimizer.precision_aware=false"
            )
    else:
        for key in ("main_params_dtype", "moments_dtype"):
            if getattr(opt, key) != "fp32":
                errors.append(
                    f"optimizer.{key}={getattr(opt, key)!r} needs optimizer.precision_aware=true (without it "
                    "Megatron-Core keeps fp32 main parameters and moments)"
                )
