"""Run under torchrun: a student actor and a distillation teacher of another architecture (resident, built in the
actor's layout by `teacher_from_hf`) at tensor-parallel degree --tp; the teacher's log-probs and top-4 of a batch.

Writes JSON (rank 0): `resident` (whether the teacher is a second model), `log_probs`, `topk_ids`, `topk_log_probs`
(tests/megatron_backend/actor/test_teacher.py).
"""

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--batch", required=True, help="JSON: input_ids (padded), lengths, response_starts")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    from megatron_rl.config.options import ModelOptions
    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.actor.teacher import ResidentTeacher, teacher_from_hf
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.models.architecture import model_dims
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.parallel_layout import ParallelLayout

    layout = ParallelLayout(tp=args.tp)
    init_distributed(layout, seed=7, dims=model_dims(read_hf_config(args.student)))
    actor = MegatronActor.from_hf(args.student, layout, model_options=ModelOptions(dtype="fp32"), micro_batch_tokens=64)
    teacher = teacher_from_hf(actor, args.teacher)
    rows = json.loads(open(args.batch).read())
    batch = TokenBatch(*(torch.tensor(rows[k]) for k in ("input_ids", "lengths", "response_starts")))
    with teacher.swapped_in() as scoring:
        scored = scoring.compute_log_probs(batch, top_k=4)
    if torch.distributed.get_rank() == 0:
        result = {
            "resident": isinstance(teacher, ResidentTeacher),
            "log_probs": scored.log_probs.tolist(),
            "topk_ids": scored.topk_ids.tolist(),
            "topk_log_probs": scored.topk_log_probs.tolist(),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    shutdown()


if __name__ == "__main__":
    main()
