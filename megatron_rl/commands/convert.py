"""`megatron-rl convert`: Hugging Face <-> Megatron distributed checkpoint, streaming, layout-independent.

    megatron-rl convert hf-to-megatron HF_DIR OUT_DIR [--dtype auto|fp32|bf16|fp16]
    megatron-rl convert megatron-to-hf CHECKPOINT OUT_DIR [--hf-extras HF_DIR] [--expect-config HF_DIR]
    megatron-rl convert lora-to-hf CHECKPOINT OUT_DIR [--merged HF_DIR] [--base HF_DIR]   # a model.lora run's

The Megatron checkpoint loads into any TP/EP/PP/VPP layout (`megatron-rl logprobs --checkpoint`,
training); CHECKPOINT may be a converted checkpoint, a `step_*` directory written by `megatron-rl train`
or the directory holding them (its latest). Runs in one process; no GPU needed.
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ["auto", "fp32", "bf16"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    direction = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_megatron = direction.add_parser("hf-to-megatron", help="HF model directory -> Megatron distributed checkpoint")
    to_megatron.add_argument("source", help="HF model directory (config.json + safetensors)")
    to_megatron.add_argument("output", help="new directory for the Megatron checkpoint")
    to_megatron.add_argument("--dtype", choices=DTYPES, default="auto", help="stored dtype (auto = torch_dtype)")
    to_hf = direction.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF model directory")
    to_hf.add_argument("source", help="Megatron checkpoint (converted, a train step_* dir, or their parent)")
    to_hf.add_argument("output", help="new directory for the HF model")
    to_hf.add_argument("--dtype", choices=DTYPES, default="auto", help="written dtype (auto = torch_dtype)")
    to_hf.add_argument("--bucket-mb", type=int, default=256, help="MiB read and written at a time (one shard)")
    to_hf.add_argument(
        "--hf-extras",
        help="HF directory to copy tokenizer/generation files from (default: the checkpoint's hf/, or for a "
        "training checkpoint the model named in its run's config.yaml)",
    )
    to_hf.add_argument(
        "--expect-config", help="HF directory whose architecture the checkpoint must have (refused otherwise)"
    )
    lora = direction.add_parser("lora-to-hf", help="a LoRA run's checkpoint -> peft adapter (and merged HF model)")
    lora.add_argument("source", help="a LoRA run's checkpoint (a step_* dir, or their parent)")
    lora.add_argument("output", help="new directory for the peft adapter (adapter_config.json + safetensors)")
    lora.add_argument("--merged", help="also write the merged model (W + alpha/r BA) as an HF model directory here")
    lora.add_argument("--base", help="the base HF model (default: model.hf_path of the run's config.yaml)")


def run(args: argparse.Namespace) -> int:
    from megatron_rl.megatron_backend.weights.conversion import hf_to_megatron, megatron_to_hf

    if args.direction == "lora-to-hf":
        from megatron_rl.megatron_backend.lora.export import lora_to_hf

        run = lora_to_hf(args.source, args.output, base=args.base, merged=args.merged)
        merged = f" and the merged model {args.merged}" if args.merged else ""
        print(f"wrote the peft adapter {args.output}{merged} (base {run.base}, rank {run.lora.rank})")
        return 0
    if args.direction == "hf-to-megatron":
        report = hf_to_megatron(args.source, args.output, dtype=args.dtype)
    else:
        report = megatron_to_hf(
            args.source,
            args.output,
            hf_extras_from=args.hf_extras,
            expect_config=args.expect_config,
            dtype=args.dtype,
            bucket_mb=args.bucket_mb,
        )
    print(f"wrote {args.output}: {report}")
    for note in report.notes:
        print(f"megatron-rl convert: warning: {note}", file=sys.stderr)
    return 0
