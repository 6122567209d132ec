"""Every way a config can be wrong fails at load time with a message naming the key and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.algorithms import POLICY_LOSSES
from megatron_rl.config import ConfigError, from_dict, load_config, validate

BASE = ["model.hf_path=/models/m"]


def error(overrides: list[str], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, [*BASE, *overrides] if path is None else overrides)
    return str(info.value)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)  # the CLI reports ValueErrors without a traceback


# ---------------------------------------------------------------- unknown keys
def test_unknown_key_names_full_key_lists_section_and_suggests():
    msg = error(["algo.los=gspo"])
    assert "command-line override 'algo.los=gspo'" in msg
    assert "unknown key 'algo.los'" in msg and "valid keys of section 'algo'" in msg
    assert "preset, loss, agg" in msg and "did you mean 'algo.loss'?" in msg


def test_unknown_nested_key_suggests_full_dotted_name():
    msg = error(["rollout.sampling.temprature=0.5"])
    assert "unknown key 'rollout.sampling.temprature'" in msg
    assert "did you mean 'rollout.sampling.temperature'?" in msg and "max_new_tokens" in msg


def test_unknown_section():
    msg = error(["algorithm.loss=gspo"])
    assert "unknown key 'algorithm'" in msg and "valid keys of the top level" in msg and "'algo'" in msg


def test_unknown_key_without_close_match_has_no_suggestion():
    msg = error(["trainer.zzzz=1"])
    assert "unknown key 'trainer.zzzz'" in msg and "did you mean" not in msg


def test_key_below_a_value():
    msg = error(["algo.loss.name=gspo"])
    assert "'algo.loss' is a value, not a section" in msg


def test_unknown_key_in_yaml_names_file(tmp_path: Path):
    path = write(tmp_path, "model: {hf_path: m}\nrollout:\n  n_sample: 4\n")
    msg = error([], path)
    assert str(path) in msg and "unknown key 'rollout.n_sample'" in msg and "did you mean 'rollout.n_samples'?" in msg


def test_unknown_key_in_reused_dataclass_section(tmp_path: Path):
    msg = error([], write(tmp_path, "model: {hf_path: m}\nparallel: {tensor_parallel: 2}\n"))
    assert "unknown key 'parallel.tensor_parallel'" in msg and "tp, pp, vpp, ep, etp, cp, sp" in msg


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.n_samples=four", "rollout.n_samples='four': expected integer, got str"),
        ("rollout.n_samples=2.5", "rollout.n_samples=2.5: expected integer, got float"),
        ("rollout.n_samples=true", "rollout.n_samples=True: expected integer, got bool"),
        ("optimizer.lr=fast", "optimizer.lr='fast': expected number, got str"),
        ("optimizer.lr=.nan", "optimizer.lr: NaN is not a valid value"),
        ("algo.overlong_filter=yes", "algo.overlong_filter='yes': expected bool (true/false), got str"),
        ("algo.overlong_filter=1", "algo.overlong_filter=1: expected bool (true/false), got int"),
        ("algo.clip_c=big", "algo.clip_c='big': expected number or null, got str"),
        ("data.train=[a, b]", "data.train=['a', 'b']: expected string or list of mapping (TrainSource), got list"),
        ("rollout.sampling.stop_token_ids=[1, x]", "rollout.sampling.stop_token_ids[1]='x': expected integer"),
        ("rollout.sampling=3", "'rollout.sampling' is a section; expected a mapping"),
        ("model.hf_path=null", "model.hf_path=None: expected string"),
    ],
)
def test_bad_value_names_key_value_and_type(override: str, expected: str):
    assert expected in error([override])


def test_literal_lists_valid_values_and_suggests():
    msg = error(["algo.routing_replay=r2"])
    assert "algo.routing_replay='r2': must be one of 'off', 'R2', 'R3'" in msg and "did you mean 'R2'?" in msg
    msg = error(["rollout.engine=vllm"])
    assert "must be one of 'local', 'sglang'" in msg
    assert "'none', 'grpo', 'dapo', 'gspo', 'sapo', 'dr_grpo', 'cispo', 'ppo', 'vapo'" in error(["algo.preset=trpo"])


@pytest.mark.parametrize(
    ("override", "kind", "valid"),
    [
        ("algo.loss=gpso", "policy loss", "cispo, gspo, gspo_token, ppo, sapo"),
        ("algo.agg=token_mean", "aggregation mode", "seq-mean-token-mean"),
        ("algo.advantage=grpo2", "advantage estimator", "dr_grpo, gae, grpo, reinforce_pp, rloo"),
        ("algo.kl_estimator=k33", "KL estimator", "k1, k2, k3, low_var_kl"),
    ],
)
def test_registry_names_checked_against_registry(override: str, kind: str, valid: str):
    msg = error([override])
    assert f"not a registered {kind}" in msg
    assert valid in msg and "did you mean" in msg


def test_registry_message_lists_current_registry():
    msg = error(["algo.loss=nope"])
    assert ", ".join(POLICY_LOSSES.names()) in msg


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.n_samples=0", "rollout.n_samples=0: must be >= 1"),
        ("algo.clip_low=-0.1", "algo.clip_low=-0.1: must be >= 0"),
        ("algo.clip_c=1.0", "algo.clip_c=1.0: must be > 1"),
        ("algo.tau_neg=0", "algo.tau_neg=0.0: must be > 0"),
        ("algo.kl_coef=-1", "algo.kl_coef=-1.0: must be >= 0"),
        ("rollout.sglang.mem_fraction_static=1.5", "must be <= 1"),
        ("algo.agg_norm=0", "algo.agg_norm=0.0: must be > 0"),
    ],
)
def test_bounds(override: str, expected: str):
    assert expected in error([override])


def test_missing_hf_path_is_required():
    with pytest.raises(ConfigError, match=r"model.hf_path is required: Hugging Face model directory"):
        load_config(None, [])


def test_parallel_layout_errors_are_config_errors():
    msg = error(["parallel.vpp=2"])
    assert msg.startswith("parallel: vpp=2 requires pp > 1")
    assert "parallel: sp=True requires tp > 1" in error(["parallel.sp=true"])
    assert "parallel: tp must be a positive integer" in error(["parallel.tp=0"])
    assert "parallel: pp_first_stage_layers=2 requires pp > 1" in error(["parallel.pp_first_stage_layers=2"])


# ---------------------------------------------------------------- files and override syntax
def test_override_without_equals():
    msg = error(["algo.loss"])
    assert "override 'algo.loss' is not key=value" in msg


def test_missing_file():
    with pytest.raises(ConfigError, match="config file 'nope.yaml' not found"):
        load_config("nope.yaml")


def test_malformed_yaml(tmp_path: Path):
    msg = error([], write(tmp_path, "model: [unclosed\n"))
    assert "not valid YAML" in msg


def test_yaml_not_a_mapping(tmp_path: Path):
    msg = error([], write(tmp_path, "- a\n- b\n"))
    assert "expected a mapping of sections" in msg


def test_yaml_section_not_a_mapping(tmp_path: Path):
    msg = error([], write(tmp_path, "model: /models/m\n"))
    assert "'model' is a section; expected a mapping of its keys" in msg


def test_bad_value_in_yaml_names_file(tmp_path: Path):
    path = write(tmp_path, "model: {hf_path: m}\ntrainer: {steps: many}\n")
    msg = error([], path)
    assert msg.startswith(f"{path}: trainer.steps='many': expected integer")


# ---------------------------------------------------------------- cross-field checks
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algo.agg=seq-mean-token-sum-norm"],
            "algo.agg='seq-mean-token-sum-norm' needs algo.agg_norm, a constant normaliser",
        ),
        (["algo.loss=gspo", "algo.clip_c=3"], "algo.clip_c (dual clip) applies to algo.loss='ppo' only"),
        (["rollout.n_samples=1"], "rollout.n_samples=1: algo.advantage='grpo' is group-relative"),
        (
            ["rollout.n_samples=1", "algo.dynamic_sampling=true"],
            "algo.dynamic_sampling needs rollout.n_samples > 1",
        ),
        (["algo.advantage=rloo", "algo.norm_adv_by_std=false"], "algo.norm_adv_by_std=false has no effect"),
        (["algo.overlong_buffer=128"], "algo.overlong_buffer=128 must be < rollout.sampling.max_new_tokens=128"),
        (
            ["rollout.prompts_per_step=3", "rollout.n_samples=3", "algo.mini_batches_per_step=2"],
            "= 9 samples per step do not split into algo.mini_batches_per_step=2",
        ),
        (
            ["algo.rollout_correction=icepop", "algo.rollout_correction_low=6"],
            "icepop keeps weights in [low, high]",
        ),
        (
            ["algo.routing_replay=R2", "model.options.routing_replay=false"],
            "algo.routing_replay=R2 needs routers built for replay",
        ),
        (["rollout.weight_sync=disk"], "the local engine runs in the trainer process"),
        (["trainer.colocate=false"], "rollout.engine='local' runs inside the trainer process"),
        (
            ["rollout.engine=sglang", "rollout.weight_sync=distributed"],
            "cannot hold two ranks on one GPU",
        ),
        (
            ["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.num_servers=2"],
            "set only one of them",
        ),
        (["rollout.engine=sglang", "rollout.sglang.urls=[a:1]"], "are not http(s)://host:port addresses"),
        (
            [
                "rollout.engine=sglang",
                "rollout.sglang.router=true",
                "rollout.sglang.num_servers=4",
                "rollout.sglang.router_port=30002",
            ],
            "collides with the server ports 30000..30003",
        ),
        (["rollout.sampling.max_new_tokens=0"], "rollout.sampling.max_new_tokens=0 must be >= 1"),
        (["rollout.sampling.top_p=0"], "rollout.sampling.top_p=0.0 must be in (0, 1]"),
        (["rollout.sampling.temperature=-1"], "rollout.sampling.temperature=-1.0 must be >= 0"),
        (["rollout.sampling.top_k=0"], "rollout.sampling.top_k=0 must be -1"),
        (["data.eval_every=5"], "data.eval_every=5 but data.eval is null"),
        (["data.eval=synthetic"], "data.eval='synthetic' is never used with data.eval_every=0"),
        (["data.reward=my rewards"], "data.reward='my rewards' is neither a reward name nor an import path"),
        (["trainer.micro_batch_tokens=64"], "trainer.micro_batch_tokens=64 is below rollout.sampling.max_new_tokens"),
        (["trainer.resume=/no/such/ckpt"], "trainer.resume='/no/such/ckpt': no such checkpoint"),
        (["optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
        (["optimizer.warmup_steps=2000"], "optimizer.warmup_steps=2000 exceeds optimizer.total_steps=1000"),
        (["optimizer.adam_beta2=1"], "optimizer.adam_beta2=1.0 must be in [0, 1)"),
        (["optimizer.min_lr=1"], "optimizer.min_lr=1.0 must be in [0, optimizer.lr="),
    ],
)
def test_invalid_combinations(overrides: list[str], expected: str):
    assert expected in error(overrides)


def test_several_errors_are_reported_together():
    msg = error(["rollout.n_samples=1", "data.eval_every=3", "optimizer.lr=0"])
    assert msg.startswith("invalid configuration:")
    assert "rollout.n_samples=1" in msg and "data.eval_every=3" in msg and "optimizer.lr=0.0" in msg


def test_routing_replay_needs_moe_model(tmp_path: Path):
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    msg = error([f"model.hf_path={dense}", "algo.routing_replay=R3"])
    assert "algo.routing_replay=R3 needs a MoE model" in msg
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    assert load_config(None, [f"model.hf_path={moe}", "algo.routing_replay=R3"]).algo.routing_replay == "R3"


def test_moe_ppo_without_replay_is_a_note(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 8}))
    cfg = from_dict({"model": {"hf_path": str(tmp_path)}})
    assert any("GSPO paper (Fig. 3)" in n for n in validate(cfg))


def test_notes_for_unusual_but_valid_settings():
    cfg = from_dict({"model": {"hf_path": "m"}, "algo": {"loss": "gspo", "agg_norm": 5.0}})
    notes = validate(cfg)
    assert any("almost never clips" in n for n in notes) and any("agg_norm=5.0 is unused" in n for n in notes)
    cfg = from_dict({"model": {"hf_path": "m"}, "optimizer": {"lr_schedule": "cosine"}, "trainer": {"steps": 10}})
    assert any("does not finish" in n for n in validate(cfg))


def test_resume_existing_path_is_accepted(tmp_path: Path):
    assert load_config(None, [*BASE, f"trainer.resume={tmp_path}"]).trainer.resume == str(tmp_path)


def test_from_dict_checks_types_but_not_combinations():
    with pytest.raises(ConfigError, match="expected integer"):
        from_dict({"model": {"hf_path": "m"}, "rollout": {"n_samples": "x"}})
    cfg = from_dict({"model": {"hf_path": "m"}, "rollout": {"n_samples": 1}})  # invalid combination, built anyway
    with pytest.raises(ConfigError, match="group-relative"):
        validate(cfg)
