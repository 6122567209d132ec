"""The Python entry point: `from megatron_rl import train, RLConfig`, lazily (no Megatron on `import megatron_rl`);
the README's example runs as printed; a config built in Python trains as the same YAML does on the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import AlgoConfig, ModelConfig, RLConfig, load_config
from megatron_rl.config.loader import configure

REPO = Path(__file__).parents[1]
UNTIMED = ("time/", "perf/", "memory/", "sync/", "actor/ppo_kl_first_checked")  # a resumed run verifies its first
# sync and checks its first update against a scoring pass (docs/algorithms.md), as a fresh one does at step 1


def _readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(UNTIMED)} for r in rows]


def test_import_is_lazy() -> None:
    check = (
        "import sys, megatron_rl\n"
        "heavy = ('megatron.core', 'megatron_rl.trainer', 'megatron_rl.api')\n"
        "assert not any(m.startswith(heavy) for m in sys.modules)\n"
        "from megatron_rl import RLConfig, load_config, train\n"
        "import megatron_rl.api, megatron_rl.config\n"
        "assert train is megatron_rl.api.train and RLConfig is megatron_rl.config.RLConfig\n"
        "assert load_config is megatron_rl.config.load_config and 'train' in dir(megatron_rl)\n"
        "try:\n    megatron_rl.nothing\nexcept AttributeError as err:\n    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "module 'megatron_rl' has no attribute 'nothing'"


def test_readme_example_trains_and_matches_the_cli(tmp_path: Path) -> None:
    """The README's code (its run folder moved to tmp_path) trains two steps; `megatron-rl train` of the config it
    wrote (config.yaml) into another folder logs the same rows: the CLI runs the same function."""
    api_out, cli_out = tmp_path / "api", tmp_path / "cli"
    script = tmp_path / "example.py"
    script.write_text(_readme_example().replace("runs/api_demo", str(api_out)))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reward, folder = proc.stdout.strip().splitlines()[-1].split()
    assert folder == str(api_out)
    rows = _rows(api_out)
    assert [r["step"] for r in rows] == [1, 2] and float(reward) == rows[-1]["rollout/reward_mean"]
    resolved = load_config(api_out / "config.yaml")
    assert (resolved.rollout.prompts_per_step, resolved.rollout.n_samples) == (4, 4)
    assert resolved.rollout.sampling.max_new_tokens == 16 and resolved.model.tokenizer_path == str(api_out / "model")
    assert resolved.algo.rollout_correction == "none"  # `auto` resolved as load_config resolves it (sync mode)
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(api_out / "config.yaml"),
               f"trainer.output_dir={cli_out}"]  # fmt: skip
    cli = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-3000:]
    assert _rows(cli_out) == rows
    assert rows[0]["rollout/response_len_mean"] > 0


def test_a_config_built_in_python_gets_its_preset_and_keeps_what_was_loaded() -> None:
    """In Python a preset fills the algo keys left at their defaults, as in a YAML file; an algo section that
    load_config resolved is kept whole (grpo with kl_coef=0: the KL stays off)."""
    built = configure(RLConfig(model=ModelConfig(hf_path="/models/x"), algo=AlgoConfig(preset="grpo", clip_high=0.3)))
    assert (built.algo.kl_coef, built.algo.clip_low, built.algo.clip_high) == (0.04, 0.2, 0.3)
    assert built.model.tokenizer_path == "/models/x"
    loaded = load_config(None, ["model.hf_path=/models/x", "algo.preset=grpo", "algo.kl_coef=0"])
    assert loaded.algo.kl_coef == 0.0
    assert configure(loaded) == loaded
    assert configure(loaded, ["rollout.n_samples=4"]).rollout.n_samples == 4


def test_a_bad_config_built_in_python_is_refused_like_a_file() -> None:
    from megatron_rl.config import ConfigError, DataConfig

    cfg = RLConfig(model=ModelConfig(hf_path="/models/x"), data=DataConfig(eval_every=5))
    with pytest.raises(ConfigError, match=r"^data.eval_every=5 but data.eval is null"):
        configure(cfg)
