"""The cost of one training update's optimizer side: the non-finite check, the gradient norm and clip, Adam.

One process (gloo, TP=PP=EP=1), the demo's trainer settings (distributed optimizer, clip 1.0, fp32, packing,
1,024-token micro-batches), a batch of 32 random samples of 28-44 tokens (one of the demo's two updates per
step), a policy-gradient loss. Times `MegatronActor.train_step` and, inside it, the forward-backward schedule;
the rest of the update (non-finite check, grad norm, clip, Adam step, metrics) is "step - fwd/bwd". Medians
over `--steps` updates after two warm-up updates.

A/B against another checkout: run this file with `PYTHONPATH=<that checkout>` (it uses only the public actor
API), interleaved with runs on this one::

    python benchmarks/bench_optimizer_step.py --spec medium --threads 2 --steps 8
    PYTHONPATH=/tmp/wt_base python benchmarks/bench_optimizer_step.py --spec medium --threads 2 --steps 8

Prints one JSON line (the `megatron_rl` it imported, the spec, parameters, medians and spreads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SPECS = {
    "demo": {},
    "bench": "BENCH_SPEC",
    "medium": dict(
        hidden_size=384,
        intermediate_size=768,
        moe_intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=48,
        num_experts=32,
        num_experts_per_tok=4,
    ),
}


def _spec(name: str):
    from megatron_rl import tiny_model

    chosen = SPECS[name]
    return getattr(tiny_model, chosen) if isinstance(chosen, str) else tiny_model.TinyQwen3MoeSpec(**chosen)


def _batch(rows: int, vocab: int, seed: int):
    from megatron_rl.megatron_backend.actor.batch import TokenBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(28, 45, (rows,), generator=gen)
    s = int(lengths.max())
    ids = torch.randint(4, vocab, (rows, s), generator=gen)
    starts = torch.full((rows,), 20)
    for i in range(rows):
        ids[i, lengths[i] :] = 3
    batch = TokenBatch(ids, lengths, starts)
    adv = torch.randn(rows, 1, generator=gen).expand(rows, s).contiguous()
    batch.fields.update(loss_mask=batch.response_mask().float(), advantages=adv)
    return batch


def _loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb) -> tuple:
    mask = mb.fields["loss_mask"]
    loss_sum = -(log_probs * mb.fields["advantages"] * mask).sum()
    count = mask.sum().to(torch.int)
    return loss_sum, count, {"pg_loss": loss_sum.detach() / count.clamp(min=1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", choices=sorted(SPECS), default="medium", help="model size")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--steps", type=int, default=8, help="timed updates (after 2 warm-up updates)")
    parser.add_argument("--rows", type=int, default=32, help="samples per update")
    parser.add_argument(
        "--optimizer", choices=("distributed", "plain"), default="distributed",
        help="optimizer.distributed_optimizer true (the default) or false",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.disable = True  # as the tests: no torch.compile of Megatron's fusers on CPU

    import megatron_rl
    from megatron_rl import tiny_model
    from megatron_rl.config.options import OptimizerOptions
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    spec = _spec(args.spec)
    init_distributed(ParallelLayout(), seed=1234)
    options = OptimizerOptions(lr=1e-4, clip_grad=1.0, distributed_optimizer=args.optimizer == "distributed")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model.make_tiny_qwen3_moe(Path(tmp) / "model", spec)
        actor = MegatronActor.from_hf(model_dir, ParallelLayout(), optimizer_options=options, micro_batch_tokens=1024)
    params = sum(p.numel() for m in actor.modules for p in m.parameters())
    fwd_bwd: list[float] = []
    run = actor._run

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            fwd_bwd.append(time.perf_counter() - t0)

    actor._run = timed_run  # this benchmark's timer only
    steps, rest = [], []
    for i in range(args.steps + 2):
        batch = _batch(args.rows, spec.vocab_size, seed=i)
        t0 = time.perf_counter()
        metrics = actor.train_step(batch, _loss)
        dt = time.perf_counter() - t0
        if i >= 2:
            steps.append(dt)
            rest.append(dt - fwd_bwd[-1])
    shutdown()

    def summary(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    print(json.dumps({
        "megatron_rl": str(Path(megatron_rl.__file__).parent), "spec": args.spec, "threads": args.threads,
        "optimizer": args.optimizer,
        "params": params, "update_s": summary(steps), "fwd_bwd_s": summary(fwd_bwd[2:]),
        "step_minus_fwd_bwd_s": summary(rest), "last_grad_norm": metrics["grad_norm"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
