"""Multi-turn rollouts through any `RolloutEngine`: environments answer each turn until done or a limit.

All unfinished trajectories of a batch advance together, one `engine.generate` call per turn (the engine batches
them; SGLang reuses the shared prefix from its radix cache), as verl's agent loop runs its episodes concurrently.
The engine sees each turn as a fresh prompt (the sequence so far) and returns that turn's tokens, log-probs and
weight version; the trajectory keeps them aligned to the one final sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_rl.rollout.env import Environment, Observation
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.trajectory import Trajectory, TrajectoryBuilder


@dataclass(frozen=True)
class TurnLimits:
    """Limits of one trajectory (`params.max_new_tokens` caps each turn)."""

    max_turns: int = field(default=4, metadata={"help": "model turns per trajectory", "ge": 1})
    max_tokens: int = field(default=2048, metadata={"help": "tokens per trajectory, prompt included", "ge": 2})


def generate_with_envs(
    engine: RolloutEngine,
    envs: list[Environment],
    prompts: list[Prompt],
    params: SamplingParams,
    tokenizer,
    limits: TurnLimits,
    *,
    return_routed_experts: bool = False,
) -> list[Trajectory]:
    """One trajectory per (environment, prompt) pair; a fresh environment each (they keep state).

    Text observations are tokenized on their own without special tokens added (chat-template glue that starts
    after a special token, like ``<|im_end|>``, tokenizes the same as in the whole conversation). The environment
    reads each turn decoded with its special tokens. A turn the engine cut or aborted ends its trajectory unseen by
    the environment. With `params.seed` set, turn t is sampled with seed + t; the local engine draws a stream per
    row from it, SGLang's `sampling_seed` is per request (identical prompts in one call may then sample alike).
    `return_routed_experts`: each trajectory gets the routes of its final sequence (see `trajectory`).
    """
    if len(envs) != len(prompts):
        raise ValueError(f"{len(envs)} environments for {len(prompts)} prompts")
    builders = [
        TrajectoryBuilder(_token_ids(env.reset(p), tokenizer), max_turns=limits.max_turns, max_tokens=limits.max_tokens)
        for env, p in zip(envs, prompts, strict=True)
    ]
    done = [False] * len(builders)
    turn = 0
    while active := [i for i, b in enumerate(builders) if b.can_generate and not done[i]]:
        # One call per turn: capped by the largest budget left; a row that overshoots its own is cut by its builder.
        turn_params = replace(
            params,
            max_new_tokens=min(params.max_new_tokens, max(builders[i].remaining_tokens for i in active)),
            seed=None if params.seed is None else params.seed + turn,
        )
        prompts_now = [builders[i].tokens for i in active]
        samples = engine.generate(prompts_now, turn_params, n=1, return_routed_experts=return_routed_experts)
        for i, s in zip(active, samples, strict=True):
            b = builders[i]
            b.add_turn(s.response_ids, s.response_log_probs, s.weight_version, s.finish_reason, s.routed_experts)
            if b.ended is not None:
                continue
            result = envs[i].step(tokenizer.decode(s.response_ids), s.response_ids)
            b.credit(result.reward, result.info)
            done[i] = result.done
            if not result.done and b.can_generate:
                b.add_observation(_token_ids(result.observation, tokenizer))
        turn += 1
    return [b.build(done=d) for b, d in zip(builders, done, strict=True)]


def _token_ids(observation: Observation, tokenizer) -> list[int]:
    if isinstance(observation, str):
        return list(tokenizer(observation, add_special_tokens=False)["input_ids"]) if observation else []
    return list(observation)
