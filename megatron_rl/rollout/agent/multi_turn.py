"""Multi-turn rollouts through any `RolloutEngine`: environments answer each turn until done or a limit.

All unfinished trajectories of a batch advance together, one `engine.generate` call per turn (the engine batches
them; SGLang reuses the shared prefix from its radix cache), as verl's agent loop runs its episodes concurrently.
The engine sees each turn as a fresh prompt (the sequence so far) and returns that turn's tokens, log-probs and
weight version; the trajectory keeps them aligned to the one final sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from megatron_rl.config.sampling import SamplingParams, TurnLimits
from megatron_rl.rollout.agent.env import Environment, GenerateFn, Observation, get_env, get_generate_fn
from megatron_rl.rollout.agent.tools.isolation import IsolationUnavailable
from megatron_rl.rollout.agent.trajectory import Trajectory, TrajectoryBuilder
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.sample import Sample


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


SEED_STRIDE = 1000  # sample k of a generate function draws with seed + k * SEED_STRIDE (turn t adds t)


class MultiTurnRollout:
    """Multi-turn generation for `dynamic_sampling.collect_batch`: `n` trajectories per prompt, each a `Sample`
    whose response holds every turn and observation, with `loss_mask` 0 on the observations.

    Built from `rollout.env` + `rollout.env_options` (one environment per trajectory, all advancing together) or
    from `rollout.generate_fn` (called once per trajectory). The sample's `metadata` gets "turn_texts" (each
    generated turn decoded: reward functions read the final answer there), "turns", "env_reward" (the
    environment's summed contributions, added to the reward function's score by `collect_batch`), the
    environment's counters under "env_metrics", and "weight_versions" spans `(version, start, end)` over response
    positions when turns came from several versions.
    """

    def __init__(
        self,
        tokenizer: Any,
        limits: TurnLimits,
        *,
        env: str | Callable[..., Environment] | None = None,
        env_options: Mapping[str, Any] | None = None,
        generate_fn: str | GenerateFn | None = None,
    ):
        if (env is None) == (generate_fn is None):
            raise ValueError("multi-turn rollouts need exactly one of rollout.env and rollout.generate_fn")
        self.tokenizer, self.limits = tokenizer, limits
        self.env_options = dict(env_options or {})
        self.env_factory = get_env(env) if env is not None else None
        self.generate_fn = get_generate_fn(generate_fn) if generate_fn is not None else None
        # What the environment asks to be warned about every step (e.g. a code tool without kernel isolation).
        self.warnings: list[str] = []
        if self.env_factory is not None:
            first = self.new_env()  # bad options fail at start-up, naming the environment, not in the first rollout
            self.warnings = list(getattr(first, "warnings", []))

    def new_env(self) -> Environment:
        assert self.env_factory is not None
        try:
            return self.env_factory(**self.env_options)
        except IsolationUnavailable:  # its message names the key and the fix already
            raise
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"rollout.env_options={self.env_options!r} do not fit environment {self.env_factory!r}: {err}"
            ) from err

    def __call__(
        self, engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams, n: int, return_routed_experts: bool
    ) -> list[Sample]:
        """`n` samples per prompt, grouped prompt by prompt (as `RolloutEngine.generate`)."""
        repeated = [p for p in prompts for _ in range(n)]
        if self.generate_fn is not None:
            trajectories = [
                self.generate_fn(
                    engine, p, replace(params, seed=None if params.seed is None else params.seed + k * SEED_STRIDE)
                )
                for k, p in enumerate(repeated)
            ]
        else:
            envs = [self.new_env() for _ in repeated]
            trajectories = generate_with_envs(
                engine,
                envs,
                repeated,
                params,
                self.tokenizer,
                self.limits,
                return_routed_experts=return_routed_experts,
            )
        return [trajectory_to_sample(t, k // n, self.tokenizer) for k, t in enumerate(trajectories)]


def trajectory_to_sample(trajectory: Trajectory, group_index: int, tokenizer: Any) -> Sample:
    """The `Sample` training takes: the whole response with its loss mask, the engine's log-probs (0.0 on
    observation tokens, which the mask keeps out of every loss), the last turn's weight version."""
    versions = trajectory.weight_versions
    metadata: dict[str, Any] = {
        "turn_texts": [tokenizer.decode(trajectory.response_ids[t.start : t.end]) for t in trajectory.turns],
        "turns": len(trajectory.turns),
        "env_reward": trajectory.reward,
        "env_metrics": dict(trajectory.metrics),
    }
    if len(set(versions)) > 1:  # spans over response positions, as the engines report them
        metadata["weight_versions"] = [(t.weight_version, t.start, t.end) for t in trajectory.turns]
    return Sample(
        prompt_ids=list(trajectory.prompt_ids),
        response_ids=list(trajectory.response_ids),
        response_log_probs=list(trajectory.response_log_probs),
        finish_reason=trajectory.finish_reason,
        weight_version=versions[-1],
        group_index=group_index,
        routed_experts=trajectory.routed_experts,
        metadata=metadata,
        loss_mask=list(trajectory.loss_mask),
    )


def multi_turn_metrics(samples: list) -> dict[str, float]:
    """Multi-turn rollouts: turns per trajectory, the environment's counters per trajectory (tool calls, tool
    errors, ...), the tool-call success rate, and the share of response tokens that are observations."""
    n = len(samples)
    counters: dict[str, float] = {}
    for s in samples:
        for name, value in s.metadata.get("env_metrics", {}).items():
            counters[name] = counters.get(name, 0.0) + value
    response = sum(len(s.response_ids) for s in samples)
    observed = sum(len(s.response_ids) - sum(s.loss_mask) for s in samples if s.loss_mask is not None)
    metrics = {
        "multi_turn/turns_mean": sum(s.metadata.get("turns", 1) for s in samples) / n,
        "multi_turn/observation_token_share": observed / max(response, 1),
        **{f"multi_turn/{name}_per_trajectory": total / n for name, total in sorted(counters.items())},
    }
    if counters.get("tool_calls"):
        metrics["multi_turn/tool_success_rate"] = 1.0 - counters.get("tool_errors", 0.0) / counters["tool_calls"]
    return metrics
