"""A distillation teacher served by Megatron (`algo.distill.served_by: megatron`), in the actor's parallel layout.

A teacher of the student's architecture is `ReferenceWeights`: its shard waits in host memory and is swapped into
the actor's model for the scoring pass. A teacher of another architecture (another size, or another family of
`models/`) is `ResidentTeacher`: a second, frozen, forward-only Megatron model (no optimizer, no gradient buffers)
built in the same layout, resident on the device for the run. Both are a `FrozenScorer` to the scoring pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

import torch

from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.actor.reference import reference_from_hf
from megatron_rl.models.architecture import same_architecture
from megatron_rl.models.hf_config import read_hf_config


class FrozenScorer(Protocol):
    """Frozen weights the scoring pass computes with: `swapped_in()` yields a model whose `compute_log_probs`
    scores with them (collective, in the actor's layout)."""

    def swapped_in(self) -> AbstractContextManager[MegatronActor]: ...


class ResidentTeacher:
    """A frozen Megatron model of another architecture than the actor's, in its parallel layout, on the device."""

    def __init__(self, model: MegatronActor):
        self.model = model

    @contextmanager
    def swapped_in(self) -> Iterator[MegatronActor]:
        """The teacher itself: nothing to swap, the actor's weights stay where they are."""
        yield self.model


def teacher_from_hf(actor: MegatronActor, model_dir: str | Path) -> FrozenScorer:
    """The teacher in `model_dir` for `actor`'s scoring pass: host-swapped weights when its architecture is the
    actor's, else a resident model built in the actor's layout (`check_teacher` refused the layouts it cannot run)."""
    hf = read_hf_config(model_dir)
    if same_architecture(actor.hf_config, hf):
        return reference_from_hf(actor, model_dir)
    # Forward only: no recompute, no aux loss, no expert-bias updates (an option of the student's family, maybe not
    # of the teacher's); routers with RouterReplay, as every actor's route pass (`MoERouters`) needs, though the
    # teacher routes naturally.
    options = dataclasses.replace(
        actor.model_options, recompute="none", aux_loss_coeff=0.0, expert_bias_update_rate=0.0, routing_replay=True
    )
    with _random_state_kept():
        model = MegatronActor.from_hf(
            model_dir, actor.layout, hf=hf, model_options=options, micro_batch_tokens=actor.micro_batch_tokens,
            balance_quadratic=actor.balance_quadratic,
        )  # fmt: skip
    for module in model.modules:
        module.requires_grad_(False)
    return ResidentTeacher(model)


@contextmanager
def _random_state_kept() -> Iterator[None]:
    """Building a model reseeds Megatron's RNG tracker and draws initial weights: put every generator back, so the
    run's random streams are the same with or without a resident teacher (and a resumed run's restored ones stay)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    cpu, accelerator, states = torch.get_rng_state(), platform.accelerator_rng_state(), tracker.get_states()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        tracker.set_states(states)
        platform.set_accelerator_rng_state(accelerator)
