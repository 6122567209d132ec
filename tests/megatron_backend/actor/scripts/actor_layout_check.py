"""Run under torchrun: score, record routes, export, and train 3 GRPO/PPO steps under one layout.

Writes JSON (rank 0) with log-probs, entropy, routes, the export-vs-checkpoint comparison and the
per-step metrics, so the test can compare layouts against the single-process run.
"""

import argparse
import json
import time

import torch

TOP_K = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--distributed-optimizer", type=int, default=1)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--lora-share-expert-a", action="store_true")
    args = parser.parse_args()

    from megatron_rl.algorithms import policy_loss
    from megatron_rl.algorithms.distillation import topk_kl
    from megatron_rl.config.options import LoRAOptions
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.megatron_backend.actor.reference import ReferenceWeights
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    layout = ParallelLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    init_distributed(layout, seed=7)
    actor = MegatronActor.from_hf(
        args.model,
        layout,
        model_options=ModelOptions(dispatcher="alltoall", recompute=args.recompute, dtype=args.dtype),
        optimizer_options=OptimizerOptions(
            lr=1e-3, clip_grad=1.0, distributed_optimizer=bool(args.distributed_optimizer)
        ),
        micro_batch_tokens=64,
        lora=LoRAOptions(rank=args.lora_rank, share_expert_a=args.lora_share_expert_a) if args.lora_rank else None,
    )
    from safetensors.torch import load_file

    reference = load_file(f"{args.model}/model.safetensors")
    exported = {name: t for bucket in actor.export_hf(bucket_bytes=1 << 16) for name, t in bucket}
    export_equal = sorted(exported) == sorted(reference) and all(
        torch.equal(exported[k], reference[k].to(exported[k].dtype)) for k in reference
    )

    batch = layout_batch()
    b, s = batch.input_ids.shape
    scored = actor.compute_log_probs(batch, with_entropy=True, route_mode="record", top_k=TOP_K)
    reference = ReferenceWeights(actor)
    advantages = torch.linspace(-1.0, 1.0, b)
    batch.fields["old_log_probs"] = scored.log_probs
    batch.fields["advantages"] = advantages.unsqueeze(1).expand(b, s).contiguous()
    # top-k distillation's term towards a teacher that ranks the policy's own top-k in reverse order
    batch.fields["teacher_topk_ids"] = scored.topk_ids
    batch.fields["teacher_topk_log_probs"] = scored.topk_log_probs.flip(-1)

    def loss_fn(logp, ent, mb, topk_log_probs=None):
        mask = mb.response_mask().to(logp.device).float()
        loss, metrics = policy_loss(
            "ppo", logp, mb.fields["old_log_probs"].to(logp.device), mb.fields["advantages"].to(logp.device), mask
        )
        count = mask.sum().to(torch.int)
        teacher = mb.fields["teacher_topk_log_probs"].to(logp.device)
        loss = loss + 0.5 * (topk_kl(teacher, topk_log_probs) * mask).sum() / mask.sum().clamp_min(1)
        return loss * count, count, {"ppo_kl": metrics["ppo_kl"], "clip_frac_high": metrics["clip_frac_high"]}

    packing = packed_vs_padded(actor, batch, scored, loss_fn)

    steps = []
    offload = {}
    for i in range(3):
        start = time.perf_counter()
        metrics = actor.train_step(batch, loss_fn)
        metrics["seconds"] = time.perf_counter() - start
        steps.append(metrics)
        if i == 0:  # park the training state on the host between two updates, as a colocated rollout does
            before = actor.compute_log_probs(batch).log_probs
            moved = actor.offload()
            params = [p for module in actor.modules for p in module.parameters()]
            grads = [p.main_grad for p in params if p.requires_grad]  # LoRA: the frozen base has none
            freed = all(t.untyped_storage().nbytes() == 0 for t in [*params, *grads])
            actor.reload()
            same = torch.equal(actor.compute_log_probs(batch).log_probs, before)
            offload = {"bytes": moved.bytes, "freed": freed, "bitwise": same}
    # First update of a step on data scored by the same weights: the ratio must be exactly 1.
    fresh = actor.compute_log_probs(batch)
    batch.fields["old_log_probs"] = fresh.log_probs
    first = actor.train_step(batch, loss_fn)
    trained = actor.compute_log_probs(batch).log_probs
    with reference.swapped_in() as ref_actor:
        ref_log_probs = ref_actor.compute_log_probs(batch).log_probs
    after = actor.compute_log_probs(batch).log_probs
    adapters = None
    if args.lora_rank:  # the trained adapters in peft's format, gathered over every layout's shards
        from megatron_rl.megatron_backend.lora.peft_format import peft_state_dict

        adapters = peft_state_dict(actor.chunks, actor.family.weight_map(actor.hf_config).num_experts)
        if adapters is not None:
            torch.save(adapters, f"{args.out}.adapters.pt")

    if torch.distributed.get_rank() == 0:
        json.dump(
            {
                "log_probs": scored.log_probs.tolist(),
                "topk_ids": scored.topk_ids.tolist(),
                "topk_log_probs": scored.topk_log_probs.tolist(),
                "entropy": scored.entropy.tolist(),
                "routes": scored.routes.long().tolist(),
                "export_equal": export_equal,
                "steps": steps,
                "ppo_kl_first_update": first["ppo_kl"],
                "reference_equals_initial": torch.equal(ref_log_probs, scored.log_probs),
                "actor_restored": torch.equal(after, trained),
                "policy_moved": not torch.equal(trained, scored.log_probs),
                "reference_host_bytes": reference.host_bytes,
                "offload": offload,
                "packing": packing,
            },
            open(args.out, "w"),
        )
    shutdown()


def layout_batch():
    """8 rows of 12-24 tokens (padding id 3), responses from position 3-7: the batch every layout scores (the
    critic's layout check too)."""
    from megatron_rl.megatron_backend.actor.batch import TokenBatch

    gen = torch.Generator().manual_seed(3)
    b, s = 8, 24
    ids = torch.randint(4, 100, (b, s), generator=gen)
    lengths = torch.randint(12, s + 1, (b,), generator=gen)
    starts = torch.randint(3, 8, (b,), generator=gen)
    for i in range(b):
        ids[i, lengths[i] :] = 3
    return TokenBatch(ids, lengths, starts)


def packed_vs_padded(actor, batch, packed, loss_fn) -> dict:
    """The packed layout (the actor's default, which scored `packed`) against the padded one on the same weights:
    scoring, one update's loss and gradient norm (at lr 0, so the weights stay), and a replay of the recorded routes
    (which must route as recorded and give the recorded pass's log-probs bitwise)."""
    import dataclasses

    packed_options = actor.model_options
    padded_options = dataclasses.replace(packed_options, packing=False)
    actor.model_options = padded_options
    padded = actor.compute_log_probs(batch, with_entropy=True, route_mode="record")
    padded_update = actor.warmup_step(batch, loss_fn, lr=0.0)
    actor.model_options = packed_options
    packed_update = actor.warmup_step(batch, loss_fn, lr=0.0)
    replayed = actor.compute_log_probs(dataclasses.replace(batch, routes=packed.routes), route_mode="replay")
    valid = torch.arange(batch.input_ids.shape[1]) < batch.lengths.unsqueeze(1)  # every real token
    return {
        "log_probs": (packed.log_probs - padded.log_probs).abs().max().item(),
        "entropy": (packed.entropy - padded.entropy).abs().max().item(),
        "routes_equal": torch.equal(packed.routes[valid], padded.routes[valid]),
        "loss": abs(packed_update["loss"] - padded_update["loss"]),
        "grad_norm": abs(packed_update["grad_norm"] - padded_update["grad_norm"]) / padded_update["grad_norm"],
        "replay_log_probs_equal": torch.equal(replayed.log_probs, packed.log_probs),
        "replay_agreement": replayed.agreement.agreement,
    }


if __name__ == "__main__":
    main()
