"""Every example config loads, validates and resolves every plugin it names; plugin modules are found next to the
config file and in the working directory; `megatron-rl launch --dry-run` resolves them before printing a plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import ConfigError, check_input_paths, load_config
from megatron_rl.rollout.agent.env import get_env, get_generate_fn
from megatron_rl.rollout.agent.tools import TOOLS
from megatron_rl.rollout.plugin_check import check_plugins
from megatron_rl.rollout.rewards import get_reward

REPO = Path(__file__).parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CLUSTER = ("qwen3_30b_a3b_", "qwen3_235b_", "deepseek_v3_671b_", "glm45_air_")


def test_the_examples_are_found() -> None:
    names = [p.name for p in EXAMPLES]
    assert sum(name.startswith(CLUSTER) for name in names) == 5 and "tiny_moe_tool_gspo.yaml" in names


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_loads_and_resolves_every_plugin(example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny examples (run from the repository root) also name only shipped data files."""
    monkeypatch.chdir(REPO)
    cfg = load_config(example)
    check_plugins(cfg.data, cfg.rollout)
    if cfg.model.build_tiny_if_missing:
        check_input_paths(cfg)
    specs = cfg.data.reward_specs()
    assert specs and all(callable(get_reward(spec.name)) for spec in specs)
    if cfg.rollout.env is not None:
        assert callable(get_env(cfg.rollout.env))
        for tool in cfg.rollout.env_options.get("tools", ()):
            assert tool in TOOLS, tool
    if cfg.rollout.generate_fn is not None:
        assert callable(get_generate_fn(cfg.rollout.generate_fn))
    if example.name.startswith(CLUSTER):
        assert [spec.name for spec in specs] == ["math"]


def test_unknown_plugins_are_all_named(tmp_path: Path) -> None:
    example = REPO / "examples" / "tiny_moe_tool_gspo.yaml"
    options = "rollout.env_options={tools: [calculator, abacus], tool_call_format: smoke_signals}"
    cfg = load_config(example, ["data.reward=no_such_reward", options])
    with pytest.raises(ConfigError) as err:
        check_plugins(cfg.data, cfg.rollout)
    lines = str(err.value).splitlines()
    assert lines[0] == "plugins that do not resolve:"
    assert lines[1].startswith("  - data.reward='no_such_reward': unknown reward 'no_such_reward': not one of [")
    assert lines[2].startswith("  - rollout.env_options.tools: 'abacus': unknown tool 'abacus': not one of [")
    assert lines[3] == (
        "  - rollout.env_options.tool_call_format='smoke_signals': unknown tool-call format 'smoke_signals': not one "
        "of ['compact', 'hermes', 'qwen3'] nor a dotted path"
    )
    assert len(lines) == 4
    cfg = load_config(example, ["rollout.generate_fn=nowhere_module:generate", "rollout.env=null"])
    with pytest.raises(ConfigError, match=r"^rollout.generate_fn='nowhere_module:generate': cannot load generate "
                       r"function 'nowhere_module:generate': No module named 'nowhere_module'$"):  # fmt: skip
        check_plugins(cfg.data, cfg.rollout)


PLUGIN = '''
from megatron_rl.rollout.rewards import register_reward

@register_reward("{name}")
def length_bonus(sample, text, metadata):
    return float(len(text))
'''


@pytest.fixture
def plugin_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A config folder outside the repository and the package path; sys.path, the plugin modules and the reward
    registry are restored afterwards."""
    from megatron_rl.rollout.rewards import REWARD_FUNCTIONS

    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "configs"
    folder.mkdir()
    yield folder
    for name in [n for n in REWARD_FUNCTIONS if n.startswith("plugin_test_")]:
        REWARD_FUNCTIONS.pop(name)
    for module in ("my_plugin_rewards", "cwd_rewards"):
        sys.modules.pop(module, None)


def test_plugins_next_to_the_config_are_imported_when_it_loads(
    plugin_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`plugins: [module]` next to the config file is imported (no PYTHONPATH), so the reward it registers
    resolves; a dotted path into a module in the working directory resolves too."""
    (plugin_folder / "my_plugin_rewards.py").write_text(PLUGIN.format(name="plugin_test_length"))
    config = plugin_folder / "run.yaml"
    config.write_text("model: {hf_path: /models/x}\nplugins: [my_plugin_rewards]\ndata: {reward: plugin_test_length}\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "cwd_rewards.py").write_text("def score(sample, text, metadata):\n    return 0.5\n")
    monkeypatch.chdir(elsewhere)
    cfg = load_config(config)
    assert cfg.plugins == ("my_plugin_rewards",)
    check_plugins(cfg.data, cfg.rollout)
    assert get_reward("plugin_test_length")(None, "abc", {}) == 3.0
    cfg = load_config(config, ["data.reward=cwd_rewards:score"])
    check_plugins(cfg.data, cfg.rollout)
    assert get_reward("cwd_rewards:score")(None, "abc", {}) == 0.5


def test_a_plugin_that_does_not_import_is_one_line(plugin_folder: Path) -> None:
    config = plugin_folder / "run.yaml"
    config.write_text("model: {hf_path: /models/x}\nplugins: [not_here_rewards]\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value) == (
        f"plugins: cannot import 'not_here_rewards' (No module named 'not_here_rewards'); searched {plugin_folder}, "
        f"{Path.cwd()} and PYTHONPATH: put the module next to the config file or in the working directory, or add "
        "its folder to PYTHONPATH"
    )


def _launch(capsys: pytest.CaptureFixture, *overrides: str) -> tuple[int, str, str]:
    example = REPO / "examples" / "qwen3_30b_a3b_gspo_8xh100.yaml"
    hf = REPO / "examples" / "hf_configs" / "qwen3_30b_a3b.json"
    code = main(["launch", "--dry-run", str(example), *overrides, "--nodes", "1", "--gpus-per-node", "8",
                 "--hf-config", str(hf)])  # fmt: skip
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_launch_dry_run_resolves_plugins_before_the_plan(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _launch(capsys)
    assert code == 0 and "GPU" in out
    code, out, err = _launch(capsys, "data.reward=math_verifyy")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(
        "megatron-rl launch: error: data.reward='math_verifyy': unknown reward 'math_verifyy': not one of ["
    )
