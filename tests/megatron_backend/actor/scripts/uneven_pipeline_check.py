"""Run under torchrun: score a batch, export the weights and train one PPO step at one (possibly uneven) layout.

Writes JSON (rank 0) with log-probs, entropy, routes, whether the export equals the checkpoint, the global indices
of the layers each pipeline stage built, and the step's loss and grad norm
(tests/megatron_backend/actor/test_uneven_pipeline.py).
"""

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--first", type=int, default=None)
    parser.add_argument("--last", type=int, default=None)
    args = parser.parse_args()

    from safetensors.torch import load_file

    from megatron_rl.algorithms import policy_loss
    from megatron_rl.config.options import ModelOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.parallel_layout import ParallelLayout

    dims = model_dims(read_hf_config(args.model))
    layout = ParallelLayout(pp=args.pp, pp_first_stage_layers=args.first, pp_last_stage_layers=args.last)
    init_distributed(layout, seed=7, dims=dims)
    actor = MegatronActor.from_hf(
        args.model,
        layout,
        model_options=ModelOptions(dispatcher="alltoall", dtype="fp32", routing_replay=True),
        optimizer_options=OptimizerOptions(lr=1e-3, clip_grad=1.0),
        micro_batch_tokens=64,
    )
    reference = load_file(f"{args.model}/model.safetensors")
    exported = {name: t for bucket in actor.export_hf(bucket_bytes=1 << 16) for name, t in bucket}
    export_equal = sorted(exported) == sorted(reference) and all(
        torch.equal(exported[k], reference[k]) for k in reference
    )
    own_layers = [layer.layer_number - 1 for module in actor.modules for layer in module.decoder.layers]
    stage_layers = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(stage_layers, own_layers)

    # Ragged rows (pad id 3 after each length) so micro-batches hold padding, prompts of different lengths.
    lengths, starts = torch.tensor([24, 20, 17, 13, 22, 15]), torch.tensor([3, 5, 4, 7, 6, 3])
    b, s = len(lengths), int(lengths.max())
    ids = torch.randint(4, 100, (b, s), generator=torch.Generator().manual_seed(3))
    ids[torch.arange(s) >= lengths[:, None]] = 3
    batch = TokenBatch(ids, lengths, starts)
    scored = actor.compute_log_probs(batch, with_entropy=True, route_mode="record")
    batch.fields["old_log_probs"] = scored.log_probs
    batch.fields["advantages"] = torch.linspace(-1.0, 1.0, b).unsqueeze(1).expand(b, s).contiguous()

    def loss_fn(logp, ent, mb):
        mask = mb.response_mask().to(logp.device).float()
        old, adv = mb.fields["old_log_probs"].to(logp.device), mb.fields["advantages"].to(logp.device)
        loss, metrics = policy_loss("ppo", logp, old, adv, mask)
        count = mask.sum().to(torch.int)
        return loss * count, count, {"ppo_kl": metrics["ppo_kl"]}

    step = actor.train_step(batch, loss_fn)
    if torch.distributed.get_rank() == 0:
        result = {
            "log_probs": scored.log_probs.tolist(),
            "entropy": scored.entropy.tolist(),
            "routes": scored.routes.long().tolist(),
            "export_equal": export_equal,
            "stage_layers": stage_layers,
            "loss": step["loss"],
            "grad_norm": step["grad_norm"],
            "ppo_kl": step["ppo_kl"],
        }
        json.dump(result, open(args.out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
