"""What a checkpoint holds of each trained model (the actor; with PPO's critic, the critic too): its sharded weights
(with LoRA, the adapters alone), its optimizer's sharded state, and the small fields of trainer_state.json (its
step, LR schedule and torch Adam's per-parameter step counts).

The actor's entries keep their historical names (`model`/`model{i}`, `optimizer`, `actor_step`, `scheduler`,
`adam_steps`); the critic's are `critic_model*` and `critic_optimizer`, its sharded keys prefixed `critic.`, and
its fields nested under `critic` in trainer_state.json.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.lora.checkpoint import adapter_sharded_state_dict, load_adapter_state

CRITIC = "critic"


def _keys(name: str, chunks: int) -> list[str]:
    """The top-level entries of a model's chunks: `model` (one chunk) or `model0`, `model1`, ...; prefixed by name."""
    prefix = f"{name}_" if name else ""
    return [f"{prefix}model"] if chunks == 1 else [f"{prefix}model{i}" for i in range(chunks)]


def trained_state(
    model: MegatronActor, metadata: dict, *, name: str = "", is_loading: bool, with_optimizer: bool = True
) -> dict:
    """`model`'s entries of the sharded state: its weights, and with `with_optimizer` its optimizer's (if any)."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    modules: list[Any] = model.modules  # GPTModels; nn.Module's stub types their attributes as Tensor | Module
    states = [m.sharded_state_dict(metadata=metadata) for m in modules]
    if model.lora is not None:
        states = [adapter_sharded_state_dict(m, s) for m, s in zip(modules, states, strict=True)]
    if name:
        for state in states:
            add_prefix_for_sharding(state, f"{name}.")
    out = dict(zip(_keys(name, len(states)), states, strict=True))
    if with_optimizer and model.optimizer is not None:
        if is_loading:
            for opt in _inner_optimizers(model):
                if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                    opt._init_optimizer_states_with_dummy_values()
        else:
            _init_unstepped_adam_state(model)
        optimizer = model.optimizer.sharded_state_dict(out, is_loading=is_loading, metadata=metadata)
        if name:
            add_prefix_for_sharding(optimizer, f"{name}.")
        out[f"{name}_optimizer" if name else "optimizer"] = optimizer
    return out


def trained_fields(model: MegatronActor) -> dict[str, Any]:
    """`model`'s step, LR schedule and Adam step counts for trainer_state.json."""
    return {
        "step": model.step,
        "scheduler": model.scheduler.state_dict() if model.scheduler is not None else None,
        "adam_steps": _adam_steps(model) if model.optimizer is not None else None,
    }


def restore_trained_state(
    model: MegatronActor, loaded: dict, fields: dict[str, Any], *, name: str = "", with_optimizer: bool
) -> None:
    """Put `model`'s loaded entries (`trained_state`) and its `trained_fields` back."""
    with torch.no_grad():
        for key, module in zip(_keys(name, len(model.modules)), model.modules, strict=True):
            if model.lora is None:
                module.load_state_dict(loaded[key], strict=True)
            else:  # adapters only: the frozen base is the HF checkpoint the actor was built from
                load_adapter_state(module, loaded[key])
        if with_optimizer:
            model.optimizer.load_state_dict(loaded[f"{name}_optimizer" if name else "optimizer"])
            if fields.get("adam_steps"):
                _restore_adam_steps(model, fields["adam_steps"])
    if with_optimizer and model.scheduler is not None and fields.get("scheduler"):
        if hasattr(model.scheduler, "num_steps"):  # Megatron's scheduler adds the saved step count to its own
            model.scheduler.num_steps = 0
        model.scheduler.load_state_dict(fields["scheduler"])
    model.step = fields["step"]


def _inner_optimizers(model: MegatronActor) -> list:
    return list(getattr(model.optimizer, "chained_optimizers", [model.optimizer]))


def _init_unstepped_adam_state(model: MegatronActor) -> None:
    """Give a torch Adam that never stepped the state its first step would create (step 0, zero moments).

    Megatron's distributed optimizer reads the step count from that state when saving and fails without it
    (a checkpoint before the first update: a run whose steps were all filtered by dynamic sampling). Torch's
    Adam initialises exactly these values lazily, so the next step is unchanged.
    """
    for opt in _inner_optimizers(model):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue  # TE / apex FusedAdam keep the step in their param groups
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:  # torch keeps a fused (or capturable) Adam's step on the parameter's device
                    on_param = group.get("fused") or group.get("capturable")
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_param else "cpu")
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _adam_steps(model: MegatronActor) -> list[float | None]:
    """The per-parameter Adam step count of each (chained) optimizer.

    Megatron's dp_reshardable optimizer format does not carry torch Adam's per-parameter `step` (it
    comes back as the dummy value 1), which would silently change Adam's bias correction after a
    resume; we store it ourselves.
    """
    steps: list[float | None] = []
    for opt in _inner_optimizers(model):
        states = list(opt.optimizer.state.values()) if hasattr(opt, "optimizer") else []
        value = states[0].get("step") if states else None
        steps.append(None if value is None else float(value))
    return steps


def _restore_adam_steps(model: MegatronActor, steps: list[float | None]) -> None:
    for opt, step in zip(_inner_optimizers(model), steps, strict=True):
        if step is None or not hasattr(opt, "optimizer"):
            continue
        for state in opt.optimizer.state.values():
            if "step" in state:
                old = state["step"]
                state["step"] = torch.full_like(old, step) if torch.is_tensor(old) else step
