"""The rollout engine a run asks for: transformers on this machine (`local`, in the trainer's process or in a
child process) or SGLang servers (connected to or launched with the command-line flags the config implies)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.weight_version import weight_version


@dataclass(frozen=True)
class EngineRun:
    """What an engine needs to know of the run besides its `rollout` section: where the run writes (SGLang's logs
    and key file), whether generation runs ahead of training (`trainer.mode: async`), whether samples carry
    their routes (`algo.routing_replay: R3`) and, when SGLang serves the LoRA adapters (`rollout.lora_sync:
    adapter`), their rank and the HF projections they adapt (`config.options.sglang_lora_modules`)."""

    output_dir: str
    asynchronous: bool = False
    return_routes: bool = False
    lora_rank: int = 0
    lora_modules: tuple[str, ...] = ()


def build_engine(rollout: RolloutConfig, run: EngineRun, model_dir: Path, device: torch.device) -> RolloutEngine:
    """The engine of the `rollout` section, serving the HF model in `model_dir` (the local engine runs on
    `device`)."""
    if rollout.engine == "local":
        return build_local_engine(rollout, run, model_dir, device)
    from megatron_rl.rollout.sglang.api_key import client_api_key, launch_api_key_file
    from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
    from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers
    from megatron_rl.rollout.sglang.sync_paths import make_weight_sync

    sg = rollout.sglang
    refuse_models_sglang_builds_differently(model_dir)
    if rollout.release_memory and device.type != "cuda":
        raise ValueError(
            "rollout.release_memory=true with rollout.engine=sglang needs GPUs: SGLang frees memory with "
            "torch_memory_saver (CUDA only), and its CPU server exits on /release_memory_occupation; set "
            "rollout.release_memory=false here"
        )
    if sg.urls:
        api_key = client_api_key(sg.api_key_file, sg.api_key_env)
        servers = SGLangServers.connect(list(sg.urls), router_url=sg.router_url or None, api_key=api_key)
    else:
        servers = SGLangServers.launch(
            SGLangLaunchConfig(
                model_path=str(model_dir),
                python=sg.python,
                num_servers=sg.num_servers,
                ports=tuple(sg.base_port + i for i in range(sg.num_servers)),
                extra_args=(*sglang_server_flags(rollout, run), *sg.extra_args),
                log_dir=str(Path(run.output_dir) / "sglang_logs"),
                startup_timeout_s=sg.startup_timeout_s,
                router=sg.router,
                router_policy=sg.router_policy,
                api_key_file=str(launch_api_key_file(sg.api_key_file, run.output_dir)),
            )
        )
    weight_sync = make_weight_sync(
        rollout.weight_sync,
        tp_size=sg.tp_size,
        master_address=sg.trainer_address,
        group_timeout_s=sg.group_timeout_s,
    )
    return SGLangEngine(servers, weight_sync=weight_sync, request_timeout_s=sg.request_timeout_s, tp_size=sg.tp_size)


def build_local_engine(rollout: RolloutConfig, run: EngineRun, model_dir: Path, device: torch.device) -> RolloutEngine:
    """`LocalEngine` in the trainer's process, or in a child process (`ProcessEngine`) per
    `rollout.engine_process`."""
    if local_engine_process(rollout, asynchronous=run.asynchronous) == "separate":
        from megatron_rl.rollout.engines.engine_process import ProcessEngine

        threads = rollout.engine_threads
        engine = ProcessEngine(model_dir, device=device, weight_version=weight_version(0), torch_threads=threads)
        if device.type == "cpu":  # both processes compute on the same cores: the engine's come out of the trainer's
            torch.set_num_threads(max(1, torch.get_num_threads() - threads))
        return engine
    from megatron_rl.rollout.engines.local_engine import LocalEngine

    return LocalEngine(model_dir, device=device, weight_version=weight_version(0))


def local_engine_process(rollout: RolloutConfig, *, asynchronous: bool) -> Literal["trainer", "separate"]:
    """Where the local engine runs: `rollout.engine_process`, with "auto" = a child process in async mode
    (`asynchronous`, so generation overlaps training), the trainer's process otherwise."""
    if rollout.engine_process != "auto":
        return rollout.engine_process
    return "separate" if asynchronous else "trainer"


# SGLang 0.5.23 builds every decoder layer of these families as MoE: it ignores `mlp_only_layers` and
# `decoder_sparse_step` (its Qwen2/Qwen3-MoE decoder layers are sparse unconditionally), so a checkpoint with a
# dense layer would be served as another model (tests/sglang/test_sglang_dense_layer_routes.py shows it).
SGLANG_ALL_MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
# SGLang 0.5.23's GPT-OSS experts use a fixed SwiGLU alpha (its `hidden_act_alpha` default), whatever config.json's
# `swiglu_alpha` says.
SGLANG_GPT_OSS_ALPHA = 1.702


def refuse_models_sglang_builds_differently(model_dir: Path) -> None:
    """A `ValueError` for a model SGLang would serve with other layers than the trainer trains."""
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config

    hf = read_hf_config(model_dir, role="model.hf_path")
    dims = model_dims(hf)
    dense = [i for i, moe in enumerate(dims.moe_layer_pattern) if not moe]
    alpha = float(hf.get("swiglu_alpha", SGLANG_GPT_OSS_ALPHA))
    if dims.model_type == "gpt_oss" and alpha != SGLANG_GPT_OSS_ALPHA:
        raise ValueError(
            f"rollout.engine=sglang cannot serve this gpt_oss model: its swiglu_alpha={alpha}, but SGLang 0.5.23 "
            f"computes its experts with alpha {SGLANG_GPT_OSS_ALPHA} (models/gpt_oss.py reads `hidden_act_alpha`, "
            "not `swiglu_alpha`), so it would generate with another model than the one trained; use "
            "rollout.engine=local"
        )
    if dims.model_type in SGLANG_ALL_MOE_FAMILIES and dense:
        raise ValueError(
            f"rollout.engine=sglang cannot serve this {dims.model_type} model: its layers {dense} are dense "
            "(mlp_only_layers / decoder_sparse_step), but SGLang 0.5.23 builds every layer of this family as MoE, "
            "so it would generate with another model than the one trained; use rollout.engine=local, or a "
            "checkpoint whose every layer is MoE"
        )


def sglang_server_flags(rollout: RolloutConfig, run: EngineRun) -> list[str]:
    """`sglang.launch_server` flags implied by the config (parallelism, memory, R3 routes, memory release, LoRA
    serving)."""
    sg = rollout.sglang
    flags = ["--tp-size", str(sg.tp_size), "--ep-size", str(sg.ep_size)]
    flags += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    if run.return_routes:
        flags.append("--enable-return-routed-experts")
    if rollout.release_memory:
        flags.append("--enable-memory-saver")
    if run.lora_rank:
        flags += ["--enable-lora", "--max-lora-rank", str(run.lora_rank), "--lora-target-modules", *run.lora_modules]
    return flags
