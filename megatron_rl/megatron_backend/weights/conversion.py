"""Checkpoint conversion, Hugging Face <-> Megatron distributed checkpoint, streaming tensor by tensor.

Both directions build the model on the meta device at TP = PP = EP = 1 (no memory) only to obtain
Megatron's own sharded state dict: global keys, global shapes and the factories that split fused tensors.
Megatron's sharded keys never depend on the parallel layout, so a converted checkpoint loads into any
TP/EP/PP/VPP layout (embedding rows are re-padded on load), and any layout's checkpoint converts back.

- HF -> Megatron: Megatron's `dist_checkpointing.save` writes the checkpoint; our storage planner builds
  each tensor from the safetensors files only when the writer asks for it and drops it once written
  (peak host memory ~ one Megatron parameter plus its HF sources).
- Megatron -> HF: a bucket of parameters at a time (`bucket_mb`, or one parameter) is read with
  `dist_checkpointing.load` and written as one safetensors shard (peak ~ the bucket plus one read buffer).

The Megatron side is a complete checkpoint in `checkpoint_format`'s layout (model only, step 0), with the
architecture in `hf_config.json` and the HF extras (tokenizer, generation config) under `hf/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from megatron_rl.formats.checkpoint_format import (
    HF_EXTRAS_DIR,
    MEGATRON_DIR,
    CheckpointError,
    error_summary,
    fresh_staging_dir,
    publish_checkpoint,
    read_checkpoint_hf_config,
    resolve_checkpoint_dir,
    write_hf_config,
    write_trainer_state,
)
from megatron_rl.formats.safetensors_files import HF_EXTRA_FILES, copy_files, write_safetensors_dir
from megatron_rl.megatron_backend.checkpoint.dist_checkpoint_files import check_checkpoint_files
from megatron_rl.megatron_backend.lora.checkpoint import lora_run
from megatron_rl.megatron_backend.weights.checkpoint_extras import copy_checkpoint_extras
from megatron_rl.megatron_backend.weights.hf_weights import (
    SafetensorsIndex,
    WeightMismatchError,
    unused_checkpoint_tensors,
)
from megatron_rl.models import get_family
from megatron_rl.models.architecture import check_same_architecture
from megatron_rl.models.family import HFConfig
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.mapping import WeightMap, WeightRule, canonical_name
from megatron_rl.net import free_port

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Checkpoint tensors the model does not use (MTP layers), stored as they came so HF -> Megatron -> HF keeps them.
UNUSED_WEIGHTS_DIR = f"{HF_EXTRAS_DIR}/unused_weights"
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class ConversionReport:
    tensors: int
    bytes: int
    seconds: float
    peak_rss_bytes: int  # the process's peak resident memory so far (ru_maxrss)
    largest_tensor_bytes: int
    start_rss_bytes: int  # resident memory when the conversion started (imports, interpreter)
    notes: tuple[str, ...] = ()  # what the output lacks and how to add it (e.g. no tokenizer found)

    def __str__(self) -> str:
        return (
            f"{self.tensors} tensors, {self.bytes / 2**30:.3f} GiB in {self.seconds:.1f} s "
            f"({self.bytes / max(self.seconds, 1e-9) / 1e9:.2f} GB/s); peak RSS {self.peak_rss_bytes / 2**30:.2f} GiB "
            f"({self.start_rss_bytes / 2**30:.2f} GiB at start), "
            f"largest tensor {self.largest_tensor_bytes / 2**20:.1f} MiB"
        )


# ---------------------------------------------------------------------------------------------- HF -> Megatron
def hf_to_megatron(
    hf_dir: str | Path, out_dir: str | Path, *, dtype: Literal["auto", "fp32", "bf16"] = "auto"
) -> ConversionReport:
    """Write the HF model in `hf_dir` as a Megatron distributed checkpoint at `out_dir` (created atomically).

    `dtype`: of the stored parameters; "auto" keeps the HF config's `torch_dtype`.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    start, start_rss = time.perf_counter(), current_rss()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf = read_hf_config(hf_dir, role="HF_DIR of `megatron-rl convert hf-to-megatron HF_DIR OUT_DIR`")
    family = get_family(hf)
    index = SafetensorsIndex(hf_dir)
    check_hf_tensors(hf, index, hf_dir)
    target = _resolve_dtype(dtype, hf)
    _check_new_output(out_dir)
    tmp = fresh_staging_dir(out_dir)
    weights = family.weight_map(hf)
    unused = sorted(
        n for names in unused_checkpoint_tensors(family, hf, weights, index.names(), hf_dir).values() for n in names
    )
    with single_process_megatron():
        model = _meta_model(hf, target)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        params = {canonical_name(n): p for n, p in tensors if weights.rule(canonical_name(n)) is not None}
        source = _HFTensorSource(index, weights, params, hf)
        source.check_shapes()
        source.fill_real_tensors()
        (tmp / MEGATRON_DIR).mkdir()
        try:
            dist_checkpointing.save(
                {"model": model.sharded_state_dict()}, str(tmp / MEGATRON_DIR), _lazy_save_strategy(source)
            )
        except CheckpointException as err:  # a BaseException: make it an ordinary error naming the cause
            raise RuntimeError(f"writing {tmp / MEGATRON_DIR} failed: {error_summary(err)}") from err
    write_trainer_state(tmp, step=0, actor_step=0, scheduler=None, adam_steps=None, world_size=1, run_id=None,
                        trainer={"step": 0, "converted_from": str(hf_dir)})  # fmt: skip
    write_hf_config(tmp, hf)
    if hf_dir.is_dir():
        (tmp / HF_EXTRAS_DIR).mkdir()
        copy_files(hf_dir, tmp / HF_EXTRAS_DIR, HF_EXTRA_FILES)
    if unused:  # kept as they are (MTP layers), so the round trip gives the checkpoint back whole
        write_safetensors_dir(tmp / UNUSED_WEIGHTS_DIR, ([(n, index.get(n))] for n in unused))
    publish_checkpoint(tmp, out_dir, overwrite=False)
    return _report(source.tensors, source.bytes, start, source.largest, start_rss)


def check_hf_tensors(hf: HFConfig, index: SafetensorsIndex, where: Path) -> None:
    """Refuse safetensors that do not fit config.json, naming the config field and both values."""
    dims = get_family(hf).dims(hf)
    names = index.names()
    embed = next((n for n in sorted(names) if n.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise WeightMismatchError(f"{where}: no *embed_tokens.weight tensor: is this a decoder-only LM checkpoint?")
    rows, cols = index.shape(embed)
    for field, configured, found in (("vocab_size", dims.vocab_size, rows), ("hidden_size", dims.hidden_size, cols)):
        if configured != found:
            raise WeightMismatchError(
                f"{where}: config.json has {field}={configured} but {embed} has shape {(rows, cols)} "
                f"({field}={found}): the config does not belong to these weights"
            )
    has_head = "lm_head.weight" in names
    if has_head == dims.tie_word_embeddings:
        raise WeightMismatchError(
            f"{where}: config.json has tie_word_embeddings={dims.tie_word_embeddings} but the checkpoint "
            f"{'has' if has_head else 'has no'} lm_head.weight: the config does not belong to these weights"
        )
    if dims.num_experts:
        layer = dims.moe_layers[0]
        in_layer = sorted(n for n in names if f"layers.{layer}." in n and ".experts." in n)
        experts = {n.split(".experts.")[1].split(".")[0] for n in in_layer}
        found = len({e for e in experts if e.isdigit()})
        if not found and in_layer:  # one tensor stacks every expert (GPT-OSS)
            found = index.shape(in_layer[0])[0]
        if found != dims.num_experts:
            raise WeightMismatchError(
                f"{where}: config.json has {dims.num_experts} experts per layer (num_experts/num_local_experts) "
                f"but layer {layer} of the checkpoint has {found}: the config does not belong to these weights"
            )


class _HFTensorSource:
    """Builds a Megatron parameter from HF tensors on demand; the writer asks for views of it."""

    def __init__(self, index: SafetensorsIndex, weights: WeightMap, params: dict[str, torch.Tensor], hf: HFConfig):
        self.index, self.weights, self.params, self.hf = index, weights, params, hf
        self._by_storage = {p.untyped_storage()._cdata: name for name, p in params.items()}
        self._cached: tuple[str, torch.Tensor] | None = None
        self.tensors = self.bytes = self.largest = 0

    def check_shapes(self) -> None:
        """Every parameter's rule applied to meta tensors of the HF shapes gives the parameter's shape."""
        missing = [n for name in self.params for n in self._rule(name).hf if n not in self.index.names()]
        if missing:
            raise WeightMismatchError(
                f"the HF checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:3]}"
            )

        def meta(name: str, expert_slot: int | None) -> torch.Tensor:
            shape = self.index.shape(name)
            return torch.empty(shape if expert_slot is None else shape[1:], device="meta")

        for name, param in self.params.items():
            rule = self._rule(name)
            built = self.weights.build(rule, meta).shape
            expected = param.shape
            if rule.vocab_padded:
                built, expected = built[1:], expected[1:]  # rows are the (padded) vocabulary, checked above
            if tuple(built) != tuple(expected):
                shapes = [self.index.shape(n) for n in rule.hf]
                raise WeightMismatchError(
                    f"{', '.join(rule.hf)} with shapes {shapes} make a {name} of shape {tuple(built)}, but "
                    f"config.json gives {tuple(expected)}: the config ({_arch_summary(self.hf)}) does not belong to "
                    "these weights"
                )

    @torch.no_grad()
    def fill_real_tensors(self) -> None:
        """Fill the tensors Megatron makes on an explicit device even under the meta context (the router's
        `expert_bias` buffer, `device=torch.cuda.current_device()` in router.py): the writer saves them as they are."""
        for name, param in self.params.items():
            if not param.is_meta:
                param.copy_(self._build(name))

    def materialize(self, meta: torch.Tensor) -> torch.Tensor:
        """The real data behind `meta`, a view (chunk, prepended axis) of one meta parameter."""
        name = self._by_storage.get(meta.untyped_storage()._cdata)
        if name is None:
            raise RuntimeError(f"no parameter behind a {tuple(meta.shape)} checkpoint tensor")
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # drop the previous parameter first
            self._cached = (name, self._build(name))
        full = self._cached[1]
        # A view: the writer copies it out only when it is a part of the parameter (torch DCP's loader).
        # `meta`'s offset is relative to its parameter; `full` may itself be a view (one expert of a fused tensor).
        part = full.as_strided(meta.size(), meta.stride(), full.storage_offset() + meta.storage_offset())
        self.tensors += 1
        self.bytes += part.nbytes
        self.largest = max(self.largest, full.nbytes)
        return part

    def _build(self, name: str) -> torch.Tensor:
        param = self.params[name]
        full = self.weights.build(self._rule(name), self.index.get, param.shape[0])
        return full.to(param.dtype).contiguous()

    def _rule(self, name: str) -> WeightRule:
        rule = self.weights.rule(name)
        if rule is None:
            raise WeightMismatchError(f"no HF weight rule for Megatron parameter {name!r}")
        return rule


def _lazy_save_strategy(source: _HFTensorSource):
    """Megatron's torch_dist save strategy, writing synchronously with a planner that materialises tensors."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class MaterializingPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            return source.materialize(data) if isinstance(data, torch.Tensor) and data.is_meta else data

    class StreamingSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(
                mcore_to_pyt_state_dict(state, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1, single_file_per_rank=True),
                planner=MaterializingPlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
            )

    return StreamingSave("torch_dist", 1)


# ---------------------------------------------------------------------------------------------- Megatron -> HF
def megatron_to_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    hf_extras_from: str | Path | None = None,
    expect_config: str | Path | None = None,
    dtype: Literal["auto", "fp32", "bf16"] = "auto",
    bucket_mb: int = 256,
) -> ConversionReport:
    """Write a Megatron checkpoint (converted, or a step of `megatron-rl train`) as an HF model directory.

    `hf_extras_from`: HF directory whose tokenizer/generation files are copied; without it they come from the
    checkpoint's `hf/` or, for a training checkpoint, the run's model (its `config.yaml`); the report's notes say
    what could not be found. `expect_config`: an HF directory whose architecture the checkpoint must have
    (refused otherwise). `dtype`: of the written tensors; "auto" = the config's `torch_dtype`. Tensors are read
    and written in groups of at most `bucket_mb` MiB (one safetensors shard each).
    """
    start, start_rss = time.perf_counter(), current_rss()
    path = resolve_checkpoint_dir(checkpoint_dir)
    check_checkpoint_files(path)  # a missing or truncated file is named before anything is read
    if lora_run(path) is not None:
        raise ValueError(
            f"{path} holds LoRA adapters only (its run trained model.lora): write them with `megatron-rl convert "
            "lora-to-hf CHECKPOINT OUT_DIR [--merged DIR]`"
        )
    hf = read_checkpoint_hf_config(path)
    if expect_config is not None:
        check_same_architecture(read_hf_config(expect_config, role="--expect-config"), hf, path)
    family = get_family(hf)
    dims = family.dims(hf)
    target = _resolve_dtype(dtype, hf)
    weights = family.weight_map(hf)
    out_dir = Path(out_dir)
    _check_new_output(out_dir)
    largest = 0

    def shards(model) -> Iterator[list[tuple[str, torch.Tensor]]]:
        nonlocal largest
        builder = weights.hf_tensor_builder(dims.vocab_size)
        for group in _groups(model.sharded_state_dict(), bucket_mb << 20):
            shard: list[tuple[str, torch.Tensor]] = []
            for name, full in _load_group(group, path / MEGATRON_DIR).items():
                rule = weights.rule(name)
                if rule is None or (dims.tie_word_embeddings and name == "output_layer.weight"):
                    continue  # not a weight of the HF model (a tied output layer, an unmapped buffer)
                largest = max(largest, full.nbytes)
                shard += [(n, t.to(target).contiguous()) for n, t in builder.add(rule, full)]
            yield shard  # an empty one (only a tied output layer) writes no file
        builder.check_finished()
        unused = path / UNUSED_WEIGHTS_DIR
        if unused.is_dir():
            index = SafetensorsIndex(unused)
            yield from ([(n, index.get(n))] for n in sorted(index.names()))

    notes: tuple[str, ...] = ()

    def non_weight_files(staging: Path) -> None:
        nonlocal notes
        config = {**hf, "torch_dtype": _HF_DTYPE_NAMES[target]}
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        notes = copy_checkpoint_extras(path, staging, out_dir, hf_extras_from)
        if not (staging / "generation_config.json").is_file():
            generation = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=1))

    with single_process_megatron():
        model = _meta_model(hf, _stored_dtype(path / MEGATRON_DIR))
        written = write_safetensors_dir(out_dir, shards(model), extra_files=non_weight_files, overwrite=False)
    return replace(_report(written.tensors, written.bytes, start, largest, start_rss), notes=notes)


def _groups(sharded_state_dict: dict, bucket_bytes: int) -> Iterator[dict]:
    """The sharded state dict's tensors in model order, in groups of at most `bucket_bytes`.

    The unit is one checkpoint tensor: every piece of the same sharded key (e.g. all experts of one layer's
    fc1, stacked on an expert axis) goes into the same group, since a single process must read it whole.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    units: dict[str, dict] = {}
    for key, value in sharded_state_dict.items():
        if isinstance(value, ShardedTensor | ShardedTensorFactory):  # _extra_state objects carry no weights
            units.setdefault(value.key, {})[key] = value
    group: dict = {}
    size = 0
    for unit in units.values():
        nbytes = sum(v.data.numel() * v.data.element_size() for v in unit.values())
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = {}, 0
        group.update(unit)
        size += nbytes
    if group:
        yield group


def _stored_dtype(megatron_dir: Path) -> torch.dtype:
    """The dtype the checkpoint's word embeddings were saved in (the model's parameter dtype)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(megatron_dir)).read_metadata().state_dict_metadata
    entry = metadata.get("embedding.word_embeddings.weight")
    return entry.properties.dtype if entry is not None and hasattr(entry, "properties") else torch.float32


def _load_group(group: dict, megatron_dir: Path) -> dict[str, torch.Tensor]:
    """Read one group of parameters (full tensors, our canonical names) from the checkpoint."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    buffers = {k: replace(v, data=torch.empty(v.data.shape, dtype=v.data.dtype)) for k, v in group.items()}
    try:
        loaded = dist_checkpointing.load(buffers, str(megatron_dir))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised naming the checkpoint
        raise CheckpointError(
            f"cannot read {sorted(group)[:2]}... from {megatron_dir}: {error_summary(err)}. Its files are all present "
            "at the sizes megatron/.metadata records, so the checkpoint does not hold the architecture its "
            "hf_config.json describes (or a file is corrupt inside)"
        ) from err
    return {canonical_name(k): v for k, v in loaded.items() if k in group}


# ---------------------------------------------------------------------------------------------- shared
@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """Megatron's parallel state at TP = PP = EP = 1 in this process (gloo), torn down on exit."""
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    if torch.distributed.is_initialized():
        raise RuntimeError("conversion runs in one process of its own (not under torchrun)")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        init_distributed(ParallelLayout(), seed=0)
        yield
    finally:
        shutdown()


def _meta_model(hf: HFConfig, dtype: torch.dtype):
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions, build_model
    from megatron_rl.parallel_layout import ParallelLayout

    options = ModelOptions(
        dtype="bf16" if dtype == torch.bfloat16 else "fp32", layer_spec="local", routing_replay=False
    )
    chunks, _ = build_model(hf, ParallelLayout(), options, meta=True)
    return chunks[0]


def _resolve_dtype(dtype: str, hf: HFConfig) -> torch.dtype:
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def _arch_summary(hf: HFConfig) -> str:
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "moe_intermediate_size", "num_experts", "num_local_experts")  # fmt: skip
    return ", ".join(f"{k}={hf[k]}" for k in keys if k in hf)


def _check_new_output(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output {out} exists and is not empty: choose a new output directory or remove it")


def _report(tensors: int, nbytes: int, start: float, largest: int, start_rss: int) -> ConversionReport:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return ConversionReport(tensors, nbytes, time.perf_counter() - start, peak, largest, start_rss)


def current_rss() -> int:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
