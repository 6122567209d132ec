"""Benchmark checkpoint conversion: peak host memory and throughput, HF -> Megatron and back.

Builds a random Qwen3-MoE checkpoint (bf16, written layer by layer, never whole in memory) of about
`--layers` x (attention + `--experts` experts) plus a 151,936-token untied vocabulary, then runs
`megatron-rl convert hf-to-megatron` and `megatron-rl convert megatron-to-hf` each in a fresh process and
samples that process's anonymous resident memory (what it allocates; file-backed mmap pages of the
safetensors are reported apart) and the tensor bytes / second it reports.
Checks the round trip is bitwise. Results: a printed table and JSON in benchmarks/results/.
Run from the repository root: `PYTHONPATH=. python benchmarks/bench_convert.py` (default ~6 GB model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RESULTS = Path(__file__).resolve().parent / "results"
# Runs one conversion in a fresh process and samples its anonymous and file-backed resident memory
# (/proc/self/status): safetensors reads through mmap, so file pages (page cache, reclaimable) show up in RSS
# although they are not allocations; RssAnon is the memory the conversion itself holds.
CONVERT = """
import json, re, sys, threading, time
peak = {"RssAnon": 0, "RssFile": 0}
def sample():
    while True:
        status = open("/proc/self/status").read()
        for key in peak:
            peak[key] = max(peak[key], int(re.search(key + r":\\s+(\\d+)", status)[1]) * 1024)
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
from megatron_rl.megatron_backend.weights import conversion
time.sleep(0.05)
start = dict(peak)
report = getattr(conversion, sys.argv[1])(sys.argv[2], sys.argv[3])
time.sleep(0.05)
print(json.dumps({"tensors": report.tensors, "bytes": report.bytes, "seconds": report.seconds,
                  "largest_tensor_bytes": report.largest_tensor_bytes, "anon_start": start["RssAnon"],
                  "anon_peak": peak["RssAnon"], "file_peak": peak["RssFile"]}))
"""


def make_model(out: Path, args: argparse.Namespace) -> tuple[int, int]:
    """Write the random checkpoint; returns (total bytes, largest tensor bytes)."""
    h, heads, kv, hd, inter, vocab = args.hidden, 16, 4, 128, args.moe_intermediate, 151936
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab, "hidden_size": h,
        "num_hidden_layers": args.layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "intermediate_size": 4 * h, "moe_intermediate_size": inter, "num_experts": args.experts,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(0)
    weight_map, total, largest = {}, 0, 0

    def shard(name: str, tensors: dict[str, tuple[int, ...]]) -> None:
        nonlocal total, largest
        made = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in tensors.items()}
        save_file(made, str(out / name), metadata={"format": "pt"})
        for k, t in made.items():
            weight_map[k] = name
            total += t.nbytes
            largest = max(largest, t.nbytes)

    shard("embed.safetensors", {"model.embed_tokens.weight": (vocab, h)})
    for i in range(args.layers):
        p = f"model.layers.{i}."
        tensors = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                   p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate.weight": (args.experts, h)}  # fmt: skip
        for e in range(args.experts):
            q = f"{p}mlp.experts.{e}."
            tensors.update({q + "gate_proj.weight": (inter, h), q + "up_proj.weight": (inter, h),
                            q + "down_proj.weight": (h, inter)})  # fmt: skip
        shard(f"layer{i:03d}.safetensors", tensors)
    shard("head.safetensors", {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total, largest


def convert(direction: str, source: Path, output: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CONVERT, direction, str(source), str(output)], capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    gib = 2**30
    return {
        "gib": r["bytes"] / gib,
        "seconds": r["seconds"],
        "gb_per_s": r["bytes"] / r["seconds"] / 1e9,
        "anon_peak_gib": r["anon_peak"] / gib,
        "anon_growth_gib": (r["anon_peak"] - r["anon_start"]) / gib,
        "file_backed_peak_gib": r["file_peak"] / gib,
        "largest_tensor_gib": r["largest_tensor_bytes"] / gib,
    }


def same_weights(a: Path, b: Path) -> bool:
    index = json.loads((a / "model.safetensors.index.json").read_text())["weight_map"]
    other = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    if sorted(index) != sorted(other):
        return False
    for name in index:
        with safe_open(a / index[name], "pt") as fa, safe_open(b / other[name], "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        total, largest = make_model(work / "hf", args)
        to_megatron = convert("hf_to_megatron", work / "hf", work / "megatron")
        to_hf = convert("megatron_to_hf", work / "megatron", work / "back")
        bitwise = same_weights(work / "hf", work / "back")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gib = 2**30
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads)",
        "command": "PYTHONPATH=. python benchmarks/bench_convert.py " + " ".join(sys.argv[1:]),
        "model": {
            "layers": args.layers,
            "experts": args.experts,
            "hidden": args.hidden,
            "dtype": "bf16",
            "weights_gib": round(total / gib, 3),
            "largest_tensor_gib": round(largest / gib, 3),
        },  # fmt: skip
        "hf_to_megatron": to_megatron,
        "megatron_to_hf": to_hf,
        "round_trip_bitwise": bitwise,
    }
    print(f"model {total / gib:.2f} GiB (bf16), largest tensor {largest / gib:.3f} GiB")
    print(f"{'direction':<16}{'GiB':>7}{'s':>7}{'GB/s':>7}{'anon peak':>11}{'growth':>8}{'file-backed':>13}")
    for name in ("hf_to_megatron", "megatron_to_hf"):
        r = result[name]
        print(f"{name:<16}{r['gib']:>7.2f}{r['seconds']:>7.1f}{r['gb_per_s']:>7.2f}{r['anon_peak_gib']:>11.2f}"
              f"{r['anon_growth_gib']:>8.2f}{r['file_backed_peak_gib']:>13.2f}")  # fmt: skip
    print(f"round trip bitwise: {bitwise}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"bench_convert_cpu_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
