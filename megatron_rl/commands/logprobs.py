"""`megatron-rl logprobs`: score token sequences with a Megatron model (single process or under torchrun).

Input JSONL, one sample per line: `input_ids` (prompt + response) and `response_start` (index of the
first response token). Output JSONL: the input fields plus
  - `log_probs`: one fp32 value per response token t, log p(input_ids[t] | input_ids[:t]);
  - `entropy`: entropy of the same next-token distribution, per response token;
  - `routed_experts`: SGLang's layout, `[len(input_ids) - 1][moe_layers][top_k]`, the experts each MoE
    layer chose for the token at each position (the last token is never fed, as in SGLang); the order
    of the k experts inside a row carries no meaning.
With `--replay-routes` the input's `routed_experts` are forced instead of the model's own routing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_rl.jsonl import read_jsonl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-model", help="Hugging Face model directory (config.json + safetensors)")
    source.add_argument(
        "--checkpoint",
        help="Megatron distributed checkpoint written by `megatron-rl train` (a step_* directory, or the "
        "checkpoints directory: its latest); loads into any --tp/--ep/--pp layout",
    )
    parser.add_argument("--input", required=True, help="JSONL with input_ids and response_start per line")
    parser.add_argument("--output", required=True, help="JSONL to write (rank 0 writes it)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank")
    parser.add_argument(
        "--pp-first-stage-layers", type=int, default=None, help="layers of the first pipeline stage (uneven stages)"
    )
    parser.add_argument(
        "--pp-last-stage-layers", type=int, default=None, help="layers of the last pipeline stage (uneven stages)"
    )
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="tensor-parallel size inside experts (default: --tp)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype")
    parser.add_argument("--temperature", type=float, default=1.0, help="score softmax(logits / temperature)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens per micro-batch")
    parser.add_argument(
        "--packing",
        choices=["on", "off"],
        default="on",
        help="on: samples packed end to end per micro-batch (THD); off: one padded row per sample",
    )
    parser.add_argument("--replay-routes", action="store_true", help="force the input's routed_experts")


def read_samples(path: Path, vocab_size: int) -> list[dict]:
    """Parse and check the input file; errors name the line and the problem."""
    if not path.is_file():
        raise FileNotFoundError(f"--input {path} does not exist")
    samples = []
    for number, sample in read_jsonl(path):
        ids = sample.get("input_ids")
        start = sample.get("response_start")
        if not isinstance(ids, list) or not isinstance(start, int):
            raise ValueError(f"{path}:{number}: each line needs a list 'input_ids' and an int 'response_start'")
        if not 1 <= start <= len(ids):
            raise ValueError(f"{path}:{number}: response_start={start} must be in [1, len(input_ids)={len(ids)}]")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{path}:{number}: token ids {bad[:5]} are outside the model's vocabulary of {vocab_size}: "
                "the input was tokenized for a different model"
            )
        samples.append(sample)
    if not samples:
        raise ValueError(f"{path} holds no samples")
    return samples


def to_batch(samples: list[dict], *, with_routes: bool, num_moe_layers: int, top_k: int, num_experts: int):
    import torch

    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.routing.cache import RouteCache

    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    cache = RouteCache(num_moe_layers, top_k, num_experts) if with_routes else None
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        if cache is not None:  # checks SGLang's layout ([len(input_ids) - 1][moe_layers][top_k]) and the ids
            given = torch.tensor(s.get("routed_experts") or [], dtype=torch.long)
            cache.put(i, given, num_tokens=len(s["input_ids"]))
    routes = None if cache is None else cache.batch_routes(list(range(len(samples))), longest)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    starts = torch.tensor([s["response_start"] for s in samples])
    return TokenBatch(ids, lengths, starts, routes=routes)


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_rl.config.options import ModelOptions
    from megatron_rl.formats.checkpoint_format import read_checkpoint_hf_config, resolve_checkpoint_dir
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.checkpoint.dist_checkpoint import load_checkpoint
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.parallel_layout import ParallelLayout

    hf = read_checkpoint_hf_config(args.checkpoint) if args.checkpoint else read_hf_config(args.hf_model)
    dims = model_dims(hf)
    samples = read_samples(Path(args.input), dims.vocab_size)
    layout = ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        ep=args.ep,
        etp=args.etp,
        pp_first_stage_layers=args.pp_first_stage_layers,
        pp_last_stage_layers=args.pp_last_stage_layers,
    )
    init_distributed(layout, seed=0, dims=dims)
    try:
        options = ModelOptions(dtype=args.dtype, routing_replay=True, packing=args.packing == "on")
        if args.checkpoint:
            actor = MegatronActor(hf, layout, model_options=options, micro_batch_tokens=args.micro_batch_tokens)
            load_checkpoint(actor, resolve_checkpoint_dir(args.checkpoint), load_optimizer=False)
        else:
            actor = MegatronActor.from_hf(
                args.hf_model, layout, model_options=options, micro_batch_tokens=args.micro_batch_tokens
            )
        batch = to_batch(
            samples,
            with_routes=args.replay_routes,
            num_moe_layers=len(dims.moe_layers),
            top_k=dims.top_k,
            num_experts=dims.num_experts,
        )
        result = actor.compute_log_probs(
            batch,
            with_entropy=True,
            route_mode="replay" if args.replay_routes else "record",
            temperature=args.temperature,
        )
        if torch.distributed.get_rank() == 0:
            write_output(Path(args.output), samples, result, replayed=args.replay_routes)
    finally:
        shutdown()
    return 0


def write_output(path: Path, samples: list[dict], result, *, replayed: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for i, sample in enumerate(samples):
            n, start = len(sample["input_ids"]), sample["response_start"]
            out = dict(sample)
            out["log_probs"] = result.log_probs[i, start:n].tolist()
            out["entropy"] = result.entropy[i, start:n].tolist()
            if not replayed:
                out["routed_experts"] = result.routes[i, : n - 1].long().tolist()
            f.write(json.dumps(out) + "\n")
    tmp.replace(path)
