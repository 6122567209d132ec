"""Run under torchrun: checkpoint save / resume / crash-during-save scenarios for the actor.

--phase full:    train 4 steps, saving after step 2; write the metrics of steps 3-4.
--phase resume:  load the latest checkpoint, train steps 3-4; write their metrics.
--phase crash:   load the latest checkpoint, start saving step 3 and die inside the write.
--phase score:   load the latest checkpoint's model only (any layout) and write log-probs.
"""

import argparse
import json
import os

import torch


def actor_batch_and_loss(model: str, layout, lora_rank: int = 0, share_expert_a: bool = False):
    """The actor (cosine LR schedule), a 6 x 20 batch and a PPO loss that these checkpoint scripts train with."""
    from megatron_rl.algorithms import policy_loss
    from megatron_rl.config.options import LoRAOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions

    actor = MegatronActor.from_hf(
        model,
        layout,
        optimizer_options=OptimizerOptions(lr=1e-3, lr_schedule="cosine", warmup_steps=1, total_steps=10),
        micro_batch_tokens=64,
        lora=LoRAOptions(rank=lora_rank, share_expert_a=share_expert_a) if lora_rank else None,
    )
    gen = torch.Generator().manual_seed(5)
    b, s = 6, 20
    ids = torch.randint(4, 100, (b, s), generator=gen)
    batch = TokenBatch(ids, torch.full((b,), s), torch.full((b,), 6))

    def loss_fn(logp, ent, mb):
        mask = mb.response_mask().to(logp.device).float()
        adv = mb.fields["advantages"].to(logp.device)
        loss, metrics = policy_loss("ppo", logp, mb.fields["old_log_probs"].to(logp.device), adv, mask)
        count = mask.sum().to(torch.int)
        return loss * count, count, {"ppo_kl": metrics["ppo_kl"]}

    return actor, batch, loss_fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", required=True, choices=["full", "resume", "crash", "score"])
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--lora-share-expert-a", action="store_true")
    args = parser.parse_args()

    from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoint
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    layout = ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep)
    init_distributed(layout, seed=11)
    actor, batch, loss_fn = actor_batch_and_loss(args.model, layout, args.lora_rank, args.lora_share_expert_a)
    b, s = batch.input_ids.shape

    def train(step: int) -> dict:
        batch.fields["old_log_probs"] = actor.compute_log_probs(batch).log_probs
        # Advantages drawn from torch's global RNG: resumed runs must restore it to match.
        batch.fields["advantages"] = torch.randn(b, 1).expand(b, s).contiguous()
        metrics = actor.train_step(batch, loss_fn)
        return {"step": step, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "lr": metrics["lr"]}

    results: dict = {}
    if args.phase == "full":
        for step in (1, 2):
            train(step)
        checkpoint.save_checkpoint(actor, args.ckpt, 2, {"data_position": 2})
        results["steps"] = [train(3), train(4)]
    elif args.phase == "resume":
        state = checkpoint.load_checkpoint(actor, checkpoint.latest_checkpoint(args.ckpt))
        results["trainer_state"] = state
        results["steps"] = [train(3), train(4)]
    elif args.phase == "crash":
        checkpoint.load_checkpoint(actor, checkpoint.latest_checkpoint(args.ckpt))
        from megatron.core import dist_checkpointing

        real_save = dist_checkpointing.save

        def dying_save(state, path, *a, **k):
            real_save(state, path, *a, **k)
            # Test hygiene only: reap the checkpoint writer's helper processes, which a real crash would
            # orphan, then die after the shards are written and before the rename.
            import multiprocessing

            for child in multiprocessing.active_children():
                child.kill()
            os._exit(17)

        dist_checkpointing.save = dying_save
        checkpoint.save_checkpoint(actor, args.ckpt, 3, {"data_position": 3})
    else:
        checkpoint.load_checkpoint(actor, checkpoint.latest_checkpoint(args.ckpt), load_optimizer=False)
        results["log_probs"] = actor.compute_log_probs(batch).log_probs.tolist()
    if torch.distributed.get_rank() == 0:
        json.dump(results, open(args.out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
