"""Bytes one weight sync sends under LoRA, each way (`rollout.lora_sync`): merged full (a start's first sync),
merged partial (later syncs: the adapted tensors' `W + (α/r) B A`) and adapter-only (the adapters, fp32).

* The demo's tiny Qwen3-MoE (fp32, the CPU demo's dtype), measured: `WeightSync` sends to a recording engine, and
  its `sync/bytes` are read, for rank 16 on attention and on attention + experts (the demo's LoRA).
* Qwen3-30B-A3B (`examples/hf_configs/qwen3_30b_a3b.json`), computed, rank 32 on attention: the HF tensors of
  transformers' model built on the meta device (bf16 merged weights; partial = its q/k/v/o_proj, checked against
  the dims' arithmetic), the adapters from the dims (q, k, v: A r x h each, B rows x r; o: A r x heads·hd, B h x r; the
  planner's count too), sent in fp32.

    python benchmarks/lora_sync_bytes.py
Results: a table on stdout and benchmarks/results/lora_sync_bytes_<date>.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class _Sink:
    """An engine that serves adapters and keeps nothing (only the bytes `WeightSync` counts matter)."""

    def update_weights(self, buckets, version: str) -> None:
        for _ in buckets:
            pass

    def load_adapter(self, tensors: dict, config: dict, version: str) -> None:
        pass


def measured_tiny(model_dir: Path, rank: int, targets: tuple[str, ...]) -> dict[str, int]:
    """Bytes of the first sync, of a later merged one and of a later adapter-only one (the tiny model, fp32)."""
    from megatron_rl.config.options import LoRAOptions
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.lora.adapters import lora_modules
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.trainer.rollout_phase import WeightSync

    actor = MegatronActor.from_hf(model_dir, ParallelLayout(), lora=LoRAOptions(rank=rank, targets=targets))
    with torch.no_grad():
        for lora in lora_modules(actor.chunks):  # a LoRA update
            for b in lora.B:
                b.normal_(0, 0.05)
    out = {}
    for mode in ("merged", "adapter") if targets == ("attention",) else ("merged",):  # what SGLang serves
        sync = WeightSync(actor, _Sink(), dataclasses.replace(RolloutConfig(), lora_sync=mode))  # type: ignore[arg-type]
        sync.send(0)
        first = sync.pop_metrics()["sync/bytes"]
        sync.send(1)
        out[f"{mode}_first"], out[f"{mode}_later"] = int(first), int(sync.pop_metrics()["sync/bytes"])
    return out


def computed_qwen3_30b(rank: int = 32) -> dict[str, int]:
    """Merged full, merged partial (attention) in bf16 and the attention adapters in fp32, for Qwen3-30B-A3B."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.config.options import LoRAOptions
    from megatron_rl.launch.lora_memory import lora_params
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config

    path = ROOT / "examples" / "hf_configs" / "qwen3_30b_a3b.json"
    hf = json.loads(path.read_text())
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    numel = {name: t.numel() for name, t in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(path.read_text())
        dims = model_dims(read_hf_config(tmp))
    h, hd, heads, groups = dims.hidden_size, dims.head_dim, dims.num_attention_heads, dims.num_query_groups
    partial = sum(n for name, n in numel.items() if name.split(".")[-2] in ATTENTION)
    assert partial == dims.num_layers * (2 * heads + 2 * groups) * hd * h  # q and o, k and v
    adapters = dims.num_layers * rank * (3 * h + (heads + 2 * groups) * hd + heads * hd + h)  # q, k, v A's; B's; o
    assert adapters == sum(lora_params(dims, LoRAOptions(rank=rank, targets=("attention",)), None))  # the planner's
    return {"merged_first": 2 * sum(numel.values()), "merged_later": 2 * partial, "adapter_later": 4 * adapters,
            "adapter_first": 2 * sum(numel.values()) + 4 * adapters}  # fmt: skip


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29563", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron_rl.megatron_backend.distributed import init_distributed
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.tiny_model import make_tiny_qwen3_moe

    init_distributed(ParallelLayout(), seed=1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_qwen3_moe(Path(tmp) / "tiny", seed=0)  # the demo's architecture (examples/tiny_moe_gspo)
        rows["tiny demo, r=16 attention (fp32, measured)"] = measured_tiny(model, 16, ("attention",))
        both = ("attention", "experts")
        rows["tiny demo, r=16 attention + experts (fp32, measured)"] = measured_tiny(model, 16, both)
    rows["Qwen3-30B-A3B, r=32 attention (bf16 + fp32 adapters, computed)"] = computed_qwen3_30b(32)
    print(f"{'model':<64} {'merged full':>14} {'merged partial':>15} {'adapter-only':>14}")
    for name, r in rows.items():
        adapter = f"{r['adapter_later']:,}" if "adapter_later" in r else "not served"
        print(f"{name:<64} {r['merged_first']:>14,} {r['merged_later']:>15,} {adapter:>14}")
    out = ROOT / "benchmarks" / "results" / f"lora_sync_bytes_{datetime.date.today():%Y%m%d}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
