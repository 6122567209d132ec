"""`rollout.lora_sync=adapter` (SGLang serves the LoRA adapters, `config/options.py`): what it refuses at load
time, each with a one-line message naming the fix, and the projections it tells SGLang to adapt."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.options import sglang_lora_modules
from megatron_rl.models.hf_config import read_hf_config

CONFIGS = Path(__file__).parents[2] / "examples" / "hf_configs"
ADAPTER = ["rollout.engine=sglang", "rollout.lora_sync=adapter", "model.lora.rank=32", "model.lora.targets=[attention]"]


def _model(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    shutil.copy(CONFIGS / f"{name}.json", tmp_path / name / "config.json")
    return tmp_path / name


def _errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return [line.removeprefix("  - ") for line in str(info.value).splitlines() if "invalid configuration" not in line]


def test_attention_adapters_on_qwen3_moe_load_and_name_q_k_v_o(tmp_path: Path) -> None:
    model = _model(tmp_path, "qwen3_30b_a3b")
    cfg = load_config(None, [f"model.hf_path={model}", *ADAPTER])
    assert cfg.rollout.lora_sync == "adapter"
    assert sglang_lora_modules(read_hf_config(model), ("attention",)) == ("q_proj", "k_proj", "v_proj", "o_proj")
    merged = load_config(None, [f"model.hf_path={model}", "model.lora.rank=32"])
    assert merged.rollout.lora_sync == "merged"  # the default: merged weights, partial after the first sync


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.targets=[attention,experts]"], "on ['experts'] (config/options.py says why); use model.lora"),
        (["model.lora.targets=[mlp]"], "SGLang cannot serve adapters on ['mlp']"),
        (["rollout.engine=local"], "needs rollout.engine=sglang"),
        (["model.lora.rank=0"], "needs adapters: set model.lora.rank > 0"),
        (["trainer.mode=async"], "needs trainer.mode=sync"),
        (["trainer.colocate=true", "rollout.release_memory=true"], "sends none; use rollout.lora_sync=merged"),
    ],
)
def test_what_sglang_cannot_serve_is_refused_with_the_fix(tmp_path: Path, overrides: list[str], message: str) -> None:
    model = _model(tmp_path, "qwen3_30b_a3b")
    errors = [e for e in _errors(f"model.hf_path={model}", *ADAPTER, *overrides) if "lora_sync" in e]
    assert len(errors) == 1 and message in errors[0], errors
    assert "\n" not in errors[0]


def test_multi_latent_attention_is_refused(tmp_path: Path) -> None:
    (error,) = _errors(f"model.hf_path={_model(tmp_path, 'deepseek_v3')}", *ADAPTER)
    assert error.startswith("rollout.lora_sync=adapter: this deepseek_v3 model's attention")
    assert error.endswith("use rollout.lora_sync=merged")


def test_connected_servers_are_told_the_flags(tmp_path: Path) -> None:
    from megatron_rl.config.validation import validate

    cfg = load_config(None, [f"model.hf_path={_model(tmp_path, 'qwen3_30b_a3b')}", *ADAPTER,
                             "rollout.sglang.urls=[http://h:30000]", "trainer.colocate=false",
                             "rollout.weight_sync=distributed"])  # fmt: skip
    (note,) = [n for n in validate(cfg) if "lora_sync" in n]
    assert note.endswith("--enable-lora --max-lora-rank 32 --lora-target-modules q_proj k_proj v_proj o_proj")
