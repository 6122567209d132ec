"""Our RL step against Hugging Face TRL's `GRPOTrainer` on the embedded demo's settings, per phase, by model size.

Both frameworks start from the same warmed-up model (our supervised warm-up, run once here; its HF export
``<work>/warm/warmup_model``) with no further warm-up, on the same prompts (the synthetic task's training stream
for the same seed, in the same order), the same reward function (``data.reward`` of examples/tiny_moe_gspo.yaml)
and the same settings: 8 prompts x 8 samples, 16 new tokens, GSPO with clip 3e-4/4e-4, two optimizer updates per
step, fp32, AdamW at lr 1e-4, ``--threads`` CPU threads. Runs are interleaved (ours, TRL, ours, TRL, ...
``--repeats`` times) so that the shared machine's drift hits both alike.

The model is the project's tiny Qwen3-MoE (`megatron_rl.tiny_model`, seed 1234) at a size of ``--spec``:
``demo`` (the example's: hidden 64, 2 layers, 8 experts top-2), ``bench`` (`BENCH_SPEC`: hidden 256, 4 layers,
16 experts top-2) or ``medium`` (hidden 384, 6 layers, 32 experts top-4, expert FFN 192); ``--hidden``,
``--layers``, ``--experts``, ``--top-k`` and ``--moe-ffn`` change the chosen spec (8 query heads, 4 KV heads).

Phases (seconds per RL step; step 1 of each run is left out, as one-time warm-up of kernels and caches):
  rollout   generation and rewards (ours: ``time/rollout``; TRL: ``_generate_and_score_completions`` less the
            old-log-prob pass inside it)
  old_logp  the old-policy log-prob pass (ours: ``time/old_logp``; TRL: its ``_get_per_token_logps_and_entropies``
            call during generation)
  train     the two updates (ours: ``time/train``; TRL: the rest of the step up to its second ``on_step_end``)
  sync      the weight sync to the engine (ours: ``time/weight_sync``; TRL generates with the training model: 0)
  step      the whole RL step (ours: ``time/step``; TRL: from generation to the second ``on_step_end``)
Ratios are ours / TRL's of the medians (goal <= 1.0). Generated tokens/s = generated tokens / step seconds.
Learning: greedy accuracy on the held-out prompts before and after each run and the mean reward per step. Repeat
r runs both sides with RL seed ``--seeds[r % len(--seeds)]`` (prompt stream, held-out prompts, sampling; the
warmed-up start is the same for all), so ``--seeds 1234,1235 --repeats 2 --eval-prompts 256`` is the learning
check of two seeds on 256 held-out prompts; "learning gap" is the mean over repeats of ours' final accuracy less
TRL's.

The matmul anchor: each phase's floating-point work, 2 x active parameters x tokens for generation and scoring
and 6 x for the updates (our scoring: only the share of tokens it scores, all but the first update's mini-batch
on steps that do not check ppo_kl_first; "active": the non-embedding parameters a token passes through, i.e.
every weight but the input embedding, the experts' scaled by top-k / experts), over the machine's `torch.mm`
throughput at that phase's matmul shapes (every weight's product at the phase's rows, and for the updates the two
backward products; measured in this process after the runs, fp32, at ``--threads`` and at one thread, the fastest
kept). That
quotient is the phase's time at matmul speed; reported per side as a fraction of its measured time (1.0 = the
phase runs at matmul speed, 0.1 = ten times slower).
Attention scores (QK^T and PV, causal) are counted separately and are not in the anchor.

Our side runs ``python -m megatron_rl.cli train``; TRL's runs benchmarks/workers/trl_grpo_worker.py under
``--trl-python`` (TRL is the optional ``bench`` extra: ``pip install -e .[bench]``). Without TRL it says so and
exits 0.

    python benchmarks/bench_vs_trl.py --spec demo --steps 30 --repeats 2 --threads 1 --trl-python /tmp/peers/bin/python
    python benchmarks/bench_vs_trl.py --spec medium --steps 6 --repeats 2 --threads 2 --work /tmp/vs_trl
Results: a table on stdout; merged per size and thread count into benchmarks/results/vs_trl_sizes.json, and the
ratio against parameter count drawn in vs_trl_sizes.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_rl.tiny_model import BENCH_SPEC, TinyQwen3MoeSpec, make_tiny_qwen3_moe  # noqa: E402

CONFIG = ROOT / "examples" / "tiny_moe_gspo.yaml"
WORKER = ROOT / "benchmarks" / "workers" / "trl_grpo_worker.py"
RESULTS = ROOT / "benchmarks" / "results" / "vs_trl_sizes.json"
PHASES = ("rollout", "old_logp", "train", "sync", "step")
WORK_PHASES = {"rollout": 2, "old_logp": 2, "train": 6}  # FLOPs per active parameter and token
TRL_VERSION = "1.16.0"  # setup.py's bench extra
COMMON = ["logging.wandb=false", "logging.plot=false"]
SEED = 1234  # the example's trainer.seed: the demo model is the one the example builds
PROMPTS, SAMPLES, UPDATES = 8, 8, 2  # the example's rollout and algo settings, the worker's defaults
SPECS = {
    "demo": TinyQwen3MoeSpec(),
    "bench": BENCH_SPEC,
    "medium": dataclasses.replace(
        BENCH_SPEC, hidden_size=384, intermediate_size=768, moe_intermediate_size=192, num_hidden_layers=6,
        head_dim=48, num_experts=32, num_experts_per_tok=4,
    ),
}  # fmt: skip


def trl_version(python: str) -> str | None:
    """TRL's version under `python`, or None when it does not import."""
    probe = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def env(threads: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONPATH": path}


def run(cmd: list[str], threads: int) -> tuple[str, float]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(threads), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout, time.perf_counter() - t


def choose_spec(args: argparse.Namespace) -> tuple[str, TinyQwen3MoeSpec]:
    """The spec of `--spec` with the size options applied, and its name (the spec's, or the sizes')."""
    spec = SPECS[args.spec]
    sizes = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_experts": args.experts,
             "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_ffn}  # fmt: skip
    changed = {k: v for k, v in sizes.items() if v is not None}
    if not changed:
        return args.spec, spec
    if "hidden_size" in changed:
        if changed["hidden_size"] % spec.num_attention_heads:
            raise SystemExit(f"--hidden {changed['hidden_size']} is not a multiple of {spec.num_attention_heads} heads")
        changed["head_dim"] = changed["hidden_size"] // spec.num_attention_heads
        changed["intermediate_size"] = 2 * changed["hidden_size"]
    spec = dataclasses.replace(spec, **changed)
    if spec.num_experts_per_tok > spec.num_experts:
        raise SystemExit(f"--top-k {spec.num_experts_per_tok} exceeds {spec.num_experts} experts")
    name = (f"h{spec.hidden_size}-l{spec.num_hidden_layers}-e{spec.num_experts}k{spec.num_experts_per_tok}"
            f"-f{spec.moe_intermediate_size}")  # fmt: skip
    return name, spec


def warm_up(work: Path, spec: TinyQwen3MoeSpec, args: argparse.Namespace) -> Path:
    """The model of `spec` after our supervised warm-up (and one RL step); reused when `work` already holds it."""
    model = work / "warm" / "warmup_model"
    if (model / "config.json").is_file():
        print(f"reusing the warm-up in {model}", flush=True)
        return model
    make_tiny_qwen3_moe(work / "model", spec, seed=SEED)
    overrides = [f"trainer.output_dir={work / 'warm'}", f"model.hf_path={work / 'model'}", "trainer.steps=1"]
    overrides += ["data.eval=null", "data.eval_every=0", f"trainer.cpu_threads={args.threads}", *COMMON]
    if args.warmup_steps is not None:
        overrides.append(f"warmup.sft_steps={args.warmup_steps}")
    print(f"warming up {work / 'model'}", flush=True)
    run([sys.executable, "-m", "megatron_rl.cli", "train", str(CONFIG), *overrides], args.threads)
    return model


def run_ours(model: Path, work: Path, args: argparse.Namespace, seed: int) -> dict:
    out = Path(tempfile.mkdtemp(dir=work, prefix="ours-"))
    overrides = [
        f"trainer.output_dir={out}",
        f"model.hf_path={model}",
        "model.build_tiny_if_missing=false",
        f"trainer.seed={seed}",
        "warmup.sft_steps=0",
        f"trainer.steps={args.steps}",
        f"data.eval_every={args.steps}",
        f"data.eval_prompts={args.eval_prompts}",
        "trainer.save_every=0",
        f"trainer.cpu_threads={args.threads}",  # the example's own would override --threads
        *COMMON,
    ]
    _, wall = run([sys.executable, "-m", "megatron_rl.cli", "train", str(CONFIG), *overrides], args.threads)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1 and "time/step" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    generated = [r["rollout/response_len_mean"] * r["rollout/samples"] for r in steps]
    total = [r["perf/tokens_per_s"] * r["time/step"] for r in steps]  # the batch's prompt + response tokens
    # The old-log-prob pass scores every mini-batch when ppo_kl_first is checked, else all but the first update's
    # (its forward gives them: algo.first_update_check); mini-batches hold equal numbers of samples.
    scored = [1.0 if r.get("actor/ppo_kl_first_checked", 1.0) else (UPDATES - 1) / UPDATES for r in steps]
    return {
        "steps": [{p: r["time/weight_sync" if p == "sync" else f"time/{p}"] for p in PHASES} for r in steps],
        "old_logp_scored_share": scored,
        "generated_tokens": generated,
        "prompt_tokens": [round(t - g) for t, g in zip(total, generated, strict=True)],
        "reward_mean": [r["rollout/reward_mean"] for r in steps],
        "eval_accuracy": {"before": evals[0], "after": evals[-1]},
        "process_seconds": wall,
    }


def run_trl(model: Path, args: argparse.Namespace, seed: int) -> dict:
    cmd = [args.trl_python, str(WORKER), "--model", str(model), "--steps", str(args.steps), "--seed", str(seed)]
    cmd += ["--eval-prompts", str(args.eval_prompts), "--threads", str(args.threads)]
    stdout, wall = run(cmd, args.threads)
    result = json.loads(stdout.rsplit("TRL_RESULT ", 1)[1].splitlines()[0])
    return {**result, "process_seconds": wall}


def summarise(run_: dict) -> dict:
    """Medians over steps 2.. of one run: seconds per phase, generated tokens/s and tokens per step."""
    steps, generated, prompt = run_["steps"][1:], run_["generated_tokens"][1:], run_["prompt_tokens"][1:]
    out = {p: statistics.median(s[p] for s in steps) for p in PHASES}
    out["tokens_per_s"] = statistics.median(n / s["step"] for n, s in zip(generated, steps, strict=True))
    out["generated_tokens"] = statistics.median(generated)
    out["prompt_tokens"] = statistics.median(prompt)
    out["old_logp_scored_share"] = statistics.median(run_.get("old_logp_scored_share", [1.0] * len(steps))[1:])
    return out


# ---------------------------------------------------------------------------------------------- matmul anchor
def weight_shapes(model: Path) -> tuple[list[tuple[str, list[int]]], dict]:
    """Every tensor's name and shape in the model's safetensors (read from the headers), and its config.json."""
    from safetensors import safe_open

    shapes = []
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes += [(name, list(f.get_slice(name).get_shape())) for name in f.keys()]  # noqa: SIM118
    return shapes, json.loads((model / "config.json").read_text())


def parameter_counts(model: Path) -> dict[str, float]:
    """Total, embedding and active parameters: an expert's weights count top-k / experts of a token's path."""
    from megatron_rl.models.architecture import model_dims

    shapes, hf = weight_shapes(model)
    dims = model_dims(hf)
    counts = {"total": 0.0, "embedding": 0.0, "active": 0.0, "experts_active": 0.0, "attention": 0.0, "lm_head": 0.0}
    for name, shape in shapes:
        n = float(math.prod(shape))
        counts["total"] += n
        if "embed_tokens" in name:
            counts["embedding"] += n
            continue
        if ".experts." in name:
            n *= dims.top_k / dims.num_experts
            counts["experts_active"] += n
        elif ".self_attn." in name:
            counts["attention"] += n
        elif name.startswith("lm_head"):
            counts["lm_head"] += n
        counts["active"] += n
    return counts


def matmuls(model: Path, rows: float, backward: bool) -> list[tuple[int, int, int]]:
    """The (m, k, n) products of one pass over `rows` tokens: every weight but the input embedding; an expert's at
    rows x top-k / experts (balanced routing); with `backward`, each weight's two gradient products too."""
    from megatron_rl.models.architecture import model_dims

    shapes, hf = weight_shapes(model)
    dims = model_dims(hf)
    out = []
    for name, shape in shapes:
        if len(shape) < 2 or "embed_tokens" in name:
            continue  # norms are elementwise
        n_out, k_in = shape[-2], shape[-1]
        expert = ".experts." in name
        m = max(1, round(rows * dims.top_k / dims.num_experts)) if expert else max(1, round(rows))
        count = shape[0] if len(shape) == 3 else 1  # stacked experts [E, out, in]
        products = [(m, k_in, n_out)] + ([(m, n_out, k_in), (k_in, m, n_out)] if backward else [])
        out += products * count
    return out


def time_matmul(m: int, k: int, n: int, cache: dict) -> float:
    """Seconds of one fp32 `torch.mm` of [m, k] @ [k, n] (the best of 5 timings of enough calls for ~5 ms)."""
    import torch

    if (m, k, n) not in cache:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        calls, t = 1, 0.0
        while t < 5e-3 and calls < 1 << 16:
            calls *= 2
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b)
            t = time.perf_counter() - start
        best = t
        for _ in range(4):
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        cache[(m, k, n)] = best / calls
    return cache[(m, k, n)]


def matmul_throughput(model: Path, tokens: dict[str, float], threads: int) -> dict[str, float]:
    """FLOP/s of `torch.mm` at each phase's shapes: generation (a prefill of every prompt, then one token of every
    sample per decode step), scoring and the updates (`UPDATES` mini-batches of the step's tokens each)."""
    import torch

    torch.set_num_threads(threads)
    samples, per_update = PROMPTS * SAMPLES, tokens["total"] / UPDATES
    decode_steps = max(1, round(tokens["generated"] / samples))
    phases = {
        "rollout": [(matmuls(model, tokens["prompt"], False), 1), (matmuls(model, samples, False), decode_steps)],
        "old_logp": [(matmuls(model, per_update, False), UPDATES)],
        "train": [(matmuls(model, per_update, True), UPDATES)],
    }
    cache: dict = {}
    out = {}
    for phase, passes in phases.items():
        flops = sum(2 * m * k * n * reps for products, reps in passes for m, k, n in products)
        seconds = sum(time_matmul(m, k, n, cache) * reps for products, reps in passes for m, k, n in products)
        out[phase] = flops / seconds
    return out


def attention_flops(hf: dict, sequences: int, length: float) -> float:
    """FLOPs of one forward's attention scores (QK^T and PV over the causal half) for `sequences` of `length`."""
    heads, head_dim, layers = hf["num_attention_heads"], hf["head_dim"], hf["num_hidden_layers"]
    return 4.0 * layers * heads * head_dim * sequences * length * (length + 1) / 2


def anchor(model: Path, params: dict, summary: dict, throughput: dict[str, float]) -> dict:
    """One side's work per phase, its time at matmul throughput, and the measured time as a fraction of it."""
    hf = json.loads((model / "config.json").read_text())
    tokens = summary["prompt_tokens"] + summary["generated_tokens"]
    samples = PROMPTS * SAMPLES
    out: dict = {"tokens_per_step": tokens}
    limit_step = 0.0
    for phase, per_token in WORK_PHASES.items():
        flops = per_token * params["active"] * tokens * (summary["old_logp_scored_share"] if phase == "old_logp" else 1)
        limit = flops / throughput[phase]
        limit_step += limit
        scores = attention_flops(hf, samples, tokens / samples) * (3 if phase == "train" else 1)
        out[phase] = {"gflop": flops / 1e9, "attention_score_gflop": scores / 1e9, "matmul_limit_s": limit,
                      "fraction_of_limit": limit / summary[phase]}  # fmt: skip
    out["step"] = {"matmul_limit_s": limit_step, "fraction_of_limit": limit_step / summary["step"]}
    return out


# ---------------------------------------------------------------------------------------------- results
def merge_results(key: str, result: dict, path: Path) -> dict:
    """`path`'s results with `key` (size/threads) replaced by `result`."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("results", {})[key] = result
    data["about"] = "benchmarks/bench_vs_trl.py: ours vs TRL's GRPOTrainer per model size and thread count"
    data["results"] = dict(sorted(data["results"].items(), key=lambda kv: (kv[1]["params"]["total"], kv[0])))
    return data


def plot_results(data: dict, path: Path) -> None:
    """Ratio ours / TRL against parameter count: a line per thread count (the step), markers per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"rollout": "o", "old_logp": "s", "train": "^"}
    colors = {1: "tab:blue", 2: "tab:orange"}
    for threads in sorted({r["settings"]["threads"] for r in data["results"].values()}):
        rows = sorted((r for r in data["results"].values() if r["settings"]["threads"] == threads),
                      key=lambda r: r["params"]["total"])  # fmt: skip
        color = colors.get(threads, None)
        x = [r["params"]["total"] for r in rows]
        ax.plot(x, [r["ratio_ours_over_trl"]["step"] for r in rows], "-D", color=color, lw=2, ms=7,
                label=f"step, {threads} thread{'s' if threads > 1 else ''}")  # fmt: skip
        for phase, marker in markers.items():
            ax.plot(x, [r["ratio_ours_over_trl"][phase] for r in rows], marker, color=color, ms=6, alpha=0.7,
                    ls="none", label=f"{phase}, {threads}t")  # fmt: skip
        for r in rows:  # the spread of the interleaved pairs' step ratios
            pairs = r["ratio_per_pair"]["step"]
            ax.vlines(r["params"]["total"], min(pairs), max(pairs), color=color, lw=5, alpha=0.25)
        for r in rows:
            ax.annotate(r["spec_name"], (r["params"]["total"], r["ratio_ours_over_trl"]["step"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)  # fmt: skip
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (total)")
    ax.set_ylabel("seconds ours / TRL (median; bar: pairs' range)")
    ax.set_title("megatron-rl vs TRL GRPOTrainer, GSPO 8x8, CPU")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def uptime() -> str:
    proc = subprocess.run(["uptime"], capture_output=True, text=True)
    return proc.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", choices=sorted(SPECS), default="demo", help="model size (see the docstring)")
    parser.add_argument("--hidden", type=int, help="hidden size (head_dim = hidden / 8, dense FFN = 2 x hidden)")
    parser.add_argument("--layers", type=int, help="decoder layers")
    parser.add_argument("--experts", type=int, help="routed experts per MoE layer")
    parser.add_argument("--top-k", type=int, help="experts per token")
    parser.add_argument("--moe-ffn", type=int, help="one expert's FFN size")
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run (the issue measured 30)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved pairs of runs (ours, TRL)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each framework")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts of the greedy accuracy")
    parser.add_argument("--seeds", default=str(SEED), help="comma-separated RL seeds, one per repeat (cycled)")
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter that has TRL")
    parser.add_argument("--model", type=Path, help="a warmed-up HF model directory (default: warm up here)")
    parser.add_argument("--work", type=Path, help="keep the warm-up here and reuse it (default: a temporary dir)")
    parser.add_argument("--warmup-steps", type=int, help="SFT warm-up steps (default: the example's)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON merged per size and thread count")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from --out's JSON")
    args = parser.parse_args()
    if args.replot:
        plot_results(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 of each run is left out)")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    name, spec = choose_spec(args)
    seeds = [int(x) for x in args.seeds.split(",")]

    version = trl_version(args.trl_python)
    if version is None:
        print(f"skipped: TRL does not import under {args.trl_python} (pip install -e .[bench], or --trl-python)")
        return
    if version != TRL_VERSION:
        print(f"note: TRL {version}, not the pinned {TRL_VERSION}")
    load_start, uptime_start = os.getloadavg(), uptime()
    print(f"{name}, {args.threads} thread(s); {uptime_start}", flush=True)
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work / name if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = args.model or warm_up(work, spec, args)
        params = parameter_counts(model)
        print(f"parameters: {params['total'] / 1e6:.2f} M total, {params['active'] / 1e6:.2f} M active", flush=True)
        for repeat in range(args.repeats):
            for side in ("ours", "trl"):
                print(f"repeat {repeat + 1}/{args.repeats}: {side} ({args.steps} steps)", flush=True)
                seed = seeds[repeat % len(seeds)]
                runs[side].append(run_ours(model, work, args, seed) if side == "ours" else run_trl(model, args, seed))
        per_run = {side: [summarise(r) for r in rs] for side, rs in runs.items()}
        median = {side: {k: statistics.median(s[k] for s in rs) for k in rs[0]} for side, rs in per_run.items()}
        both = {k: (median["ours"][f"{k}_tokens"] + median["trl"][f"{k}_tokens"]) / 2 for k in ("prompt", "generated")}
        tokens = {**both, "total": both["prompt"] + both["generated"]}
        # The matmul throughput at the step's shapes, after the runs (their token counts give the shapes), at
        # --threads and at one thread, twice each: the best of them is what the machine can do with --threads
        # cores (a second thread waits on a core another job holds; one thread does not).
        measured = {t: [matmul_throughput(model, tokens, t) for _ in range(2)] for t in sorted({1, args.threads})}
        throughput = {k: max(m[k] for ms in measured.values() for m in ms) for k in WORK_PHASES}
        anchors = {side: anchor(model, params, median[side], throughput) for side in median}
    load_end, uptime_end = os.getloadavg(), uptime()

    ratio = {k: median["ours"][k] / median["trl"][k] for k in (*PHASES, "tokens_per_s") if median["trl"][k] > 0}
    # Each interleaved pair's ratio: the spread the shared machine leaves.
    pair = {k: [o[k] / t[k] for o, t in zip(per_run["ours"], per_run["trl"], strict=True)] for k in ratio}
    print(f"\n{'per RL step (median)':<22}{'ours':>10}{'TRL':>10}{'ours/TRL':>10}   per pair")
    for k in (*PHASES, "tokens_per_s"):
        unit = "tok/s" if k == "tokens_per_s" else "s"
        spread = " ".join(f"{x:.2f}" for x in pair.get(k, []))
        r = f"{ratio[k]:>10.2f}" if k in ratio else f"{'-':>10}"
        print(f"{f'{k} ({unit})':<22}{median['ours'][k]:>10.4f}{median['trl'][k]:>10.4f}{r}   {spread}")
    threads_measured = " and ".join(str(t) for t in measured)
    print(f"\nmatmul anchor (fp32 torch.mm at the phase's shapes, the best of {threads_measured} thread(s))")
    print(f"{'phase':<10}{'GFLOP/s':>10}{'GFLOP':>9}{'attn GFLOP':>11}{'limit s':>10}{'ours frac':>10}{'TRL frac':>10}")
    for phase in (*WORK_PHASES, "step"):
        o, t = anchors["ours"][phase], anchors["trl"][phase]
        work = (f"{throughput[phase] / 1e9:>10.1f}{o['gflop']:>9.3f}{o['attention_score_gflop']:>11.4f}"
                if phase in WORK_PHASES else f"{'':>30}")  # fmt: skip
        fractions = f"{o['fraction_of_limit']:>10.3f}{t['fraction_of_limit']:>10.3f}"
        print(f"{phase:<10}{work}{o['matmul_limit_s']:>10.4f}{fractions}")
    learning = {side: [r["eval_accuracy"] for r in rs] for side, rs in runs.items()}
    for side, accs in learning.items():
        print(f"greedy accuracy {side:>4}: " + ", ".join(f"{a['before']:.3f} -> {a['after']:.3f}" for a in accs))
    gap = statistics.mean(o["after"] - t["after"] for o, t in zip(learning["ours"], learning["trl"], strict=True))
    print(f"learning gap (ours - TRL, final greedy accuracy, mean over {args.repeats} repeats): {gap:+.3f}")
    print(f"at end: {uptime_end}")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    result = {
        "spec_name": name,
        "spec": dataclasses.asdict(spec),
        "params": params,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "commit": commit.stdout.strip(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, shared with other jobs",
        "uptime_start": uptime_start,
        "uptime_end": uptime_end,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "command": ("python benchmarks/bench_vs_trl.py " + " ".join(sys.argv[1:])).strip(),
        "trl": version,
        "settings": {"steps": args.steps, "repeats": args.repeats, "threads": args.threads, "prompts": PROMPTS,
                     "eval_prompts": args.eval_prompts,
                     "samples": SAMPLES, "max_new_tokens": 16, "loss": "gspo 3e-4/4e-4", "updates_per_step": UPDATES},
        "median": median,
        "ratio_ours_over_trl": ratio,
        "ratio_per_pair": pair,
        "matmul_throughput_flops": throughput,
        "matmul_throughput_flops_by_threads": measured,
        "matmul_anchor": anchors,
        "per_run": per_run,
        "eval_accuracy": learning,
        "seeds": [seeds[r % len(seeds)] for r in range(args.repeats)],
        "learning_gap_ours_minus_trl": gap,
        "reward_mean_per_step": {side: [r["reward_mean"] for r in rs] for side, rs in runs.items()},
        "process_seconds": {side: [r["process_seconds"] for r in rs] for side, rs in runs.items()},
        "runs": runs,
    }  # fmt: skip
    data = merge_results(f"{name}/threads{args.threads}", result, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    plot_results(data, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
