"""`rollout/engines/engine_factory.py`: the SGLang flags a config implies, and the models SGLang would serve
differently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.rollout.engines.engine_factory import EngineRun, build_engine, sglang_server_flags
from megatron_rl.tiny_model import TinyQwen3MoeSpec, make_tiny_qwen3_moe
from megatron_rl.trainer.rollout_phase import engine_run


def test_flags_follow_the_config() -> None:
    cfg = load_config(None, ["model.hf_path=/m", "rollout.sglang.tp_size=2", "algo.routing_replay=R3"])
    flags = sglang_server_flags(cfg.rollout, engine_run(cfg))
    assert flags[:4] == ["--tp-size", "2", "--ep-size", "1"] and "--enable-return-routed-experts" in flags
    assert "--enable-memory-saver" not in flags and "--enable-lora" not in flags
    plain = load_config(None, ["model.hf_path=/m"]).rollout
    assert "--enable-return-routed-experts" not in sglang_server_flags(plain, EngineRun("out"))


def test_sglang_serving_the_adapters_is_launched_with_lora(tmp_path: Path) -> None:
    """`rollout.lora_sync=adapter`: the rank and the HF projections of the targets (attention: q, k, v, o)."""
    model = make_tiny_qwen3_moe(tmp_path / "m")
    cfg = load_config(None, [f"model.hf_path={model}", "rollout.engine=sglang", "rollout.lora_sync=adapter",
                             "model.lora.rank=8", "model.lora.targets=[attention]"])  # fmt: skip
    flags = sglang_server_flags(cfg.rollout, engine_run(cfg))
    assert flags[-8:] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "k_proj",
                          "v_proj", "o_proj"]  # fmt: skip


def test_sglang_refuses_a_qwen_moe_with_a_dense_layer_before_launching(tmp_path: Path) -> None:
    model = make_tiny_qwen3_moe(tmp_path / "m", TinyQwen3MoeSpec(num_hidden_layers=3, mlp_only_layers=(1,)))
    cfg = load_config(None, [f"model.hf_path={model}", "rollout.engine=sglang", f"trainer.output_dir={tmp_path / 'o'}"])
    with pytest.raises(ValueError, match=r"layers \[1\] are dense.*rollout.engine=local"):
        build_engine(cfg.rollout, engine_run(cfg), model, torch.device("cpu"))
    assert not (tmp_path / "o").exists()  # refused before any server was launched


def test_sglang_refuses_a_gpt_oss_whose_swiglu_alpha_it_would_ignore(tmp_path: Path) -> None:
    import json

    from transformers import AutoConfig

    from megatron_rl.rollout.engines.engine_factory import refuse_models_sglang_builds_differently

    config = AutoConfig.for_model("gpt_oss").to_dict()  # the 20B-like default: swiglu_alpha 1.702, served as is
    (tmp_path / "config.json").write_text(json.dumps(config))
    refuse_models_sglang_builds_differently(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "swiglu_alpha": 1.3}))
    with pytest.raises(ValueError, match=r"swiglu_alpha=1.3.*alpha 1.702.*rollout.engine=local"):
        refuse_models_sglang_builds_differently(tmp_path)
