"""Run under torchrun: checkpoints written in the background (`BackgroundSaves`) while training goes on.

Trains step 1, saves it in the background, trains step 2 (the weights change while the save is written), saves
step 2 (which waits for step 1), waits, and trains step 3; saves step 3 (the first save whose planning runs in the
writer thread: the cached plan is validated by the second) and trains step 4 while it is written. Then loads step 1
and scores the batch, loads step 3 and scores it, and loads step 2 and trains step 3 again. Writes what each rank saw
as JSON.
"""

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from checkpoint_check import actor_batch_and_loss  # the sibling script (this folder is sys.path[0])

    from megatron_rl.formats.checkpoint_format import is_complete, step_dir_name
    from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoint
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout, seed=11)
    actor, batch, loss_fn = actor_batch_and_loss(args.model, layout)
    b, s = batch.input_ids.shape
    root = Path(args.ckpt)

    def train(step: int) -> dict:
        batch.fields["old_log_probs"] = actor.compute_log_probs(batch).log_probs
        batch.fields["advantages"] = torch.randn(b, 1).expand(b, s).contiguous()  # the RNG must resume too
        metrics = actor.train_step(batch, loss_fn)
        return {"step": step, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "lr": metrics["lr"]}

    def on_disk() -> dict:
        latest = root / "latest"
        return {
            "latest": latest.read_text() if latest.is_file() else None,
            "complete": [step for step in (1, 2, 3) if is_complete(root / step_dir_name(step))],
        }

    def log_probs() -> list:
        return actor.compute_log_probs(batch).log_probs.tolist()

    results: dict = {}
    background = checkpoint.BackgroundSaves()
    train(1)
    results["step1_log_probs"] = log_probs()
    checkpoint.save_checkpoint(actor, root, 1, {"data_position": 1}, background=background)
    results["after_save1"] = on_disk()
    train(2)  # changes the weights and moments in place while step 1 is written
    results["step2_log_probs"] = log_probs()
    checkpoint.save_checkpoint(actor, root, 2, {"data_position": 2}, background=background)
    results["after_save2"] = {**on_disk(), "published": background.published}
    results["waited"] = background.wait()
    results["after_wait"] = on_disk()
    results["full_step3"] = train(3)
    results["step3_log_probs"] = log_probs()
    checkpoint.save_checkpoint(actor, root, 3, {"data_position": 3}, background=background, keep_last=3)
    train(4)  # while step 3 is written
    results["waited3"] = background.close()

    checkpoint.load_checkpoint(actor, root / step_dir_name(1))
    results["loaded1_log_probs"] = log_probs()
    checkpoint.load_checkpoint(actor, root / step_dir_name(3))
    results["loaded3_log_probs"] = log_probs()
    results["loaded2_state"] = checkpoint.load_checkpoint(actor, root / step_dir_name(2))
    results["loaded2_log_probs"] = log_probs()
    results["resumed_step3"] = train(3)
    if torch.distributed.get_rank() == 0:
        json.dump(results, open(args.out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
