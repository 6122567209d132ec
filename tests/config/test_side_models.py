"""`rollout.side_models`: validation at load, list-item overrides, and `side:<name>` resolution for a judge's url
and `algo.distill.sglang_urls`."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.side_models import launched, side_urls, with_side_urls

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_gspo.yaml"
JUDGE = "rollout.side_models=[{name: judge, hf_path: /models/judge, tp: 2}]"


def _load(*overrides: str):
    return load_config(EXAMPLE, list(overrides))


def _judge_reward(url: str) -> str:
    return f'data.reward=[{{name: judge, options: {{url: "{url}"}}}}]'


def test_an_index_override_fills_one_side_models_urls_and_side_names_resolve_to_them() -> None:
    cfg = _load(
        "rollout.side_models=[{name: judge, hf_path: /models/judge}, {name: teacher, hf_path: /models/teacher}]",
        "rollout.side_models.1.urls=[http://n2:30300]",
        "rollout.side_models.0.urls=[http://n2:30301]",
        _judge_reward("side:judge"),
        "algo.distill.teacher=/models/teacher",
        "algo.distill.served_by=sglang",
        "algo.distill.sglang_urls=[side:teacher]",
    )
    judge, teacher = cfg.rollout.side_models
    assert (judge.urls, teacher.urls, teacher.tp) == (("http://n2:30301",), ("http://n2:30300",), 1)
    assert side_urls("side:teacher", cfg.rollout.side_models) == teacher.urls
    assert side_urls("http://x:1", cfg.rollout.side_models) == ("http://x:1",)
    resolved = with_side_urls(cfg, "/run/.rollout_api_key")
    assert resolved.data.reward[0].options == {"url": "http://n2:30301", "api_key_file": "/run/.rollout_api_key"}
    assert resolved.algo.distill.sglang_urls == ("http://n2:30300",)
    assert cfg.data.reward[0].options == {"url": "side:judge"}  # the loaded config keeps the reference


def test_a_judge_of_several_servers_gets_them_all_and_keeps_its_own_key() -> None:
    cfg = _load(
        "rollout.side_models=[{name: judge, hf_path: /m, urls: [http://a:1, http://b:2]}]",
        'data.reward=[{name: judge, options: {url: "side:judge", api_key_file: mine.key}}]',
        "data.eval=[{name: held, path: synthetic, reward: [{name: judge, options: {url: 'side:judge'}}]}]",
        "data.eval_every=1",
    )
    resolved = with_side_urls(cfg, "/run/key")
    assert resolved.data.reward[0].options == {"url": ["http://a:1", "http://b:2"], "api_key_file": "mine.key"}
    assert resolved.data.eval[0].reward[0].options["url"] == ["http://a:1", "http://b:2"]


def test_side_models_without_urls_are_the_launched_ones_and_cannot_resolve_yet() -> None:
    cfg = _load(JUDGE, _judge_reward("side:judge"))
    assert launched(cfg.rollout.side_models) == [0]
    with pytest.raises(ConfigError, match="side model 'judge' has no urls yet"):
        with_side_urls(cfg, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ((JUDGE, _judge_reward("side:jugde")),
         r"^data.reward\[0\].options.url: 'side:jugde' names no side model; rollout.side_models has: judge$"),
        ((_judge_reward("side:judge"),), "'side:judge' names no side model; rollout.side_models has: none"),
        (("rollout.side_models=[{name: a, hf_path: /x}, {name: a, hf_path: /y}]",),
         r"rollout.side_models\[1\].name='a' is used twice"),
        (("rollout.side_models=[{name: 'no spaces', hf_path: /x}]",), "start with a letter"),
        (("rollout.side_models=[{name: j, hf_path: /x, urls: [n2:30300]}]",), "are not http"),
        (("rollout.side_models=[{name: j, hf_path: /x, urls: ['http://a:1'], num_servers: 2}]",), "set only one"),
        (("rollout.side_models=[{name: j}]",), r"rollout.side_models\[0\].hf_path is required"),
        (("rollout.side_models=[{name: j, hf_path: /x, tp: 0}]",), r"rollout.side_models\[0\].tp=0: must be >= 1"),
        ((JUDGE, "rollout.side_models.1.urls=[http://a:1]"), "rollout.side_models has 1 entries, so no entry 1"),
        ((JUDGE, "rollout.side_models.0.url=[http://a:1]"), "unknown key 'rollout.side_models.0.url'"),
        (("rollout.side_models=[{name: t, hf_path: /other}]", "algo.distill.teacher=/models/teacher",
          "algo.distill.served_by=sglang", "algo.distill.sglang_urls=[side:t]"),
         "'side:t' serves '/other', not algo.distill.teacher='/models/teacher'"),
        (("rollout.side_models=[{name: t, hf_path: /models/teacher, num_servers: 2}]",
          "algo.distill.teacher=/models/teacher", "algo.distill.served_by=sglang", "algo.distill.sglang_urls=[side:t]"),
         "each teacher URL scores the whole batch"),
    ],
)  # fmt: skip
def test_bad_side_models_and_references_are_refused_in_one_line(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _load(*overrides)
    assert "\n" not in str(err.value)


def test_side_models_round_trip_through_the_saved_config(tmp_path: Path) -> None:
    from megatron_rl.config import dump_yaml

    cfg = _load(JUDGE, "rollout.side_models.0.urls=[http://n2:30300]", _judge_reward("side:judge"))
    assert load_config(dump_yaml(cfg, tmp_path / "config.yaml")) == cfg
