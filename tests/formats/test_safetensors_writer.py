"""The one safetensors writer (export, conversion, disk weight sync) and the checkpoint format's atomic publish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_rl.formats import checkpoint_format as fmt
from megatron_rl.formats.safetensors_files import INDEX, safetensors_weight_map, write_safetensors_dir


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [
        [("model.norm.weight", torch.randn(5, generator=g)), ("lm_head.weight", torch.randn(3, 4, generator=g))],
        [],  # e.g. a group holding only a tied output layer
        [("model.embed_tokens.weight", torch.randn(3, 4, generator=g).to(torch.bfloat16))],
    ]


def test_shards_index_and_metadata(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    seen = []
    written = write_safetensors_dir(
        out, _buckets(), extra_files=lambda d: (seen.append(d), (d / "config.json").write_text("{}"))
    )
    assert seen == [tmp_path / ".tmp_hf"] and not seen[0].exists()
    files = ["config.json", INDEX, "model-00001.safetensors", "model-00003.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"] == {
        "lm_head.weight": "model-00001.safetensors",
        "model.embed_tokens.weight": "model-00003.safetensors",
        "model.norm.weight": "model-00001.safetensors",
    }
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == 5 * 4 + 12 * 4 + 12 * 2
    assert (written.tensors, written.bytes, written.shards) == (3, 92, 2)
    assert safetensors_weight_map(out) == index["weight_map"]
    expected = {name: t for bucket in _buckets() for name, t in bucket}
    for file in ("model-00001.safetensors", "model-00003.safetensors"):
        with safe_open(out / file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def test_a_crash_leaves_the_previous_directory_and_the_next_write_replaces_it(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    write_safetensors_dir(out, _buckets())

    def dying():
        yield _buckets()[0]
        raise RuntimeError("simulated crash mid-write")

    with pytest.raises(RuntimeError, match="simulated crash"):
        write_safetensors_dir(out, dying())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [INDEX, "model-00001.safetensors", "model-00003.safetensors"]
    )
    assert (tmp_path / ".tmp_hf").is_dir()  # the partial write, removed by the next one
    write_safetensors_dir(out, [_buckets()[2]])
    assert sorted(p.name for p in out.iterdir()) == sorted([INDEX, "model-00001.safetensors"])
    assert not (tmp_path / ".tmp_hf").exists()


def test_overwrite_false_refuses_a_directory_with_files(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    write_safetensors_dir(out, _buckets(), overwrite=False)  # an empty directory is fine
    with pytest.raises(OSError):
        write_safetensors_dir(out, _buckets(), overwrite=False)
    assert safetensors_weight_map(out)


def test_checkpoint_publish_and_state_files(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        staging = fmt.fresh_staging_dir(root / fmt.step_dir_name(step))
        fmt.write_trainer_state(staging, step=step, actor_step=step, scheduler=None, adam_steps=[3.0, None],
                                trainer={"data": step}, world_size=2, run_id="r")  # fmt: skip
        fmt.write_hf_config(staging, {"model_type": "qwen3_moe"})
        final = fmt.publish_checkpoint(staging, root / fmt.step_dir_name(step), overwrite=True)
        fmt.write_latest(root, final)
    (root / ".tmp_step_000000003").mkdir()  # a save in progress
    (root / "step_000000004").mkdir()  # incomplete: no COMPLETE
    scan = fmt.scan_checkpoints(root)
    assert [p.name for p in scan.complete] == ["step_000000001", "step_000000002"]
    assert [p.name for p in scan.incomplete] == ["step_000000004"] and scan.latest == root / "step_000000002"
    assert fmt.resolve_checkpoint_dir(root) == root / "step_000000002"
    assert fmt.read_trainer_state(scan.latest) == {"step": 2, "actor_step": 2, "scheduler": None,
                                                   "adam_steps": [3.0, None], "trainer": {"data": 2},
                                                   "world_size": 2, "run_id": "r"}  # fmt: skip
    assert fmt.read_checkpoint_hf_config(root) == {"model_type": "qwen3_moe"}
    fmt.remove_stale_staging(root)
    assert not (root / ".tmp_step_000000003").exists()
    with pytest.raises(fmt.CheckpointError, match="no complete checkpoint"):
        fmt.resolve_checkpoint_dir(root / "step_000000004")
