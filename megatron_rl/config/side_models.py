"""Frozen side models (`rollout.side_models`): named SGLang-served models beside the rollout servers, never sent
weights (an LLM judge, a distillation teacher), and the `side:<name>` references that name one where a URL goes.

    rollout:
      side_models: [{name: judge, hf_path: /models/judge-7b, tp: 2}]
    data:
      reward: {name: judge, options: {url: "side:judge"}}
    algo:
      distill: {teacher: /models/teacher, served_by: sglang, sglang_urls: ["side:teacher"]}

A side model with `urls` is connected to; one without is launched (by scripts/slurm/disaggregated.sbatch on the
rollout nodes, a colocated job having no GPU to spare; by trainer rank 0 without SLURM) and its URLs filled in before
anything uses them. `side_urls` is the one resolver.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.fields import setting

SIDE_PREFIX = "side:"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_URL = re.compile(r"^https?://[^/\s]+")


@dataclass(frozen=True)
class SideModel:
    """One frozen side model (`rollout.side_models: [{name, hf_path, ...}]`), served by SGLang, never sent weights."""

    name: str = setting(help="its name in references: `side:<name>` in a judge's url or algo.distill.sglang_urls")
    hf_path: str = setting(help="HF checkpoint the launched servers load (and the model the running ones serve)")
    num_servers: int = setting(1, help="servers to launch when urls is empty (one per tp GPUs)", ge=1)
    tp: int = setting(1, help="GPUs per launched server (SGLang --tp-size)", ge=1)
    mem_fraction_static: float = setting(
        0.8, help="GPU memory fraction a launched server takes for weights and KV cache", gt=0, le=1
    )
    urls: tuple[str, ...] = setting(
        (),
        help="running servers (http://host:port), reached with rollout.sglang's API key file; empty = launched "
        "beside the rollout servers (disaggregated.sbatch on the rollout nodes; without SLURM trainer rank 0)",
    )


def side_urls(value: str, side_models: tuple[SideModel, ...]) -> tuple[str, ...]:
    """`value` as server URLs: `side:<name>` gives that side model's `urls`, anything else is itself. ConfigError
    for an unknown name (naming the known ones) or a side model whose servers are not running yet."""
    if not value.startswith(SIDE_PREFIX):
        return (value,)
    name = value.removeprefix(SIDE_PREFIX)
    by_name = {m.name: m for m in side_models}
    if name not in by_name:
        known = ", ".join(by_name) or "none"
        raise ConfigError(f"{value!r} names no side model (rollout.side_models: {known})")
    if not by_name[name].urls:
        raise ConfigError(f"{value!r}: side model {name!r} has no urls yet (its servers are launched at start-up)")
    return by_name[name].urls


def references(cfg: Any) -> Iterator[tuple[str, str]]:
    """Every `side:` reference in `cfg` (an `RLConfig`: schema.py imports this module) as (config key, reference):
    judges' `url` options in `data.reward` and the list form of `data.eval`, and `algo.distill.sglang_urls`."""
    for key, options in _judge_options(cfg):
        url = options.get("url")
        for u in url if isinstance(url, list | tuple) else [url]:
            if isinstance(u, str) and u.startswith(SIDE_PREFIX):
                yield f"{key}.options.url", u
    for u in cfg.algo.distill.sglang_urls:
        if u.startswith(SIDE_PREFIX):
            yield "algo.distill.sglang_urls", u


def check_side_models(cfg: Any, errors: list[str]) -> None:
    """Load-time checks: names unique and usable in `side:<name>`, urls well-formed, every reference known, a
    teacher reference serving the teacher's checkpoint."""
    models = cfg.rollout.side_models
    seen: set[str] = set()
    for i, m in enumerate(models):
        key = f"rollout.side_models[{i}]"
        if not _NAME.match(m.name):
            errors.append(f"{key}.name={m.name!r}: start with a letter, then letters, digits, _ or -")
        if m.name in seen:
            errors.append(f"{key}.name={m.name!r} is used twice: give each side model its own name")
        seen.add(m.name)
        bad = [u for u in m.urls if not _URL.match(u)]
        if bad:
            errors.append(f"{key} ({m.name}): urls {bad} are not http(s)://host:port addresses")
        if m.urls and m.num_servers > 1:
            errors.append(
                f"{key} ({m.name}): urls lists running servers and num_servers={m.num_servers} asks to launch "
                "servers; set only one of them"
            )
    by_name = {m.name: m for m in models}
    for key, ref in references(cfg):
        name = ref.removeprefix(SIDE_PREFIX)
        if name not in by_name:
            known = ", ".join(by_name) or "none"
            errors.append(f"{key}: {ref!r} names no side model; rollout.side_models has: {known}")
        elif key == "algo.distill.sglang_urls" and by_name[name].hf_path != cfg.algo.distill.teacher:
            errors.append(
                f"algo.distill.sglang_urls: {ref!r} serves {by_name[name].hf_path!r}, not algo.distill.teacher="
                f"{cfg.algo.distill.teacher!r}: point both at the same checkpoint"
            )
        elif key == "algo.distill.sglang_urls" and max(by_name[name].num_servers, len(by_name[name].urls)) > 1:
            errors.append(
                f"algo.distill.sglang_urls: {ref!r} has several servers, and each teacher URL scores the whole batch: "
                "give the teacher side model one server"
            )


def launched(side_models: tuple[SideModel, ...]) -> list[int]:
    """The indices of the side models without urls: the ones a launcher starts."""
    return [i for i, m in enumerate(side_models) if not m.urls]


def with_side_urls(cfg: Any, api_key_file: str | None) -> Any:
    """`cfg` (an `RLConfig`) with every `side:` reference replaced by its side model's URLs (all of them running);
    a judge that names no `api_key_file` gets `api_key_file`, the side servers' key."""
    models = cfg.rollout.side_models
    if not models:
        return cfg

    def judge_options(options: dict[str, Any]) -> dict[str, Any]:
        url = options.get("url")
        if not isinstance(url, str) or not url.startswith(SIDE_PREFIX):
            return options
        urls = side_urls(url, models)
        keyed = {"api_key_file": api_key_file} if api_key_file and "api_key_file" not in options else {}
        return {**options, "url": urls[0] if len(urls) == 1 else list(urls), **keyed}

    def rewards(reward: Any) -> Any:
        if not isinstance(reward, tuple):
            return reward
        return tuple(replace(s, options=judge_options(s.options)) if s.name == "judge" else s for s in reward)

    data = cfg.data
    evals = data.eval
    if isinstance(evals, tuple):
        evals = tuple(replace(e, reward=rewards(e.reward)) for e in evals)
    data = replace(data, reward=rewards(data.reward), eval=evals)
    urls = tuple(u for ref in cfg.algo.distill.sglang_urls for u in side_urls(ref, models))
    algo = replace(cfg.algo, distill=replace(cfg.algo.distill, sglang_urls=urls))
    return replace(cfg, data=data, algo=algo)


def _judge_options(cfg: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key, options) of each `judge` reward of `data.reward` and of the list form of `data.eval`."""
    data = cfg.data
    places: list[tuple[str, Any]] = [("data.reward", data.reward)]
    if isinstance(data.eval, tuple):
        places += [(f"data.eval[{i}].reward", e.reward) for i, e in enumerate(data.eval)]
    for key, reward in places:
        if isinstance(reward, tuple):
            for j, spec in enumerate(reward):
                if spec.name == "judge":
                    yield f"{key}[{j}]", spec.options
