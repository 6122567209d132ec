"""Rollout throughput of both engines, and weight sync against the raw transport, on one tiny Qwen3-MoE.

1. Rollout: tokens per second of the embedded `LocalEngine` and of a real SGLang 0.5.23 server (CPU, the
   test tier's stand-ins for its CUDA-only module) generating the same prompts (`--prompts` x `--n`
   samples, `--max-new-tokens` each, sampled at temperature 1, no early stop) from the same weights.
2. Weight sync into that server, per path, `--repeats` times (median): `tensor` (`/update_weights_from_tensor`),
   `distributed` (a gloo broadcast group with the server) and `disk` (safetensors + `/update_weights_from_disk`),
   each against the raw transport of the same bytes measured in the same run: an HTTP POST of the same
   payload size to a local sink server, a plain gloo broadcast of one buffer of the same size to a helper
   process, and writing + reading the same bytes in the same directory. Budget: >= 70% of raw.

Needs the SGLang venv (`bash scripts/install_sglang_cpu.sh`). Run from the repository root:
    PYTHONPATH=. python benchmarks/bench_rollout_sync.py
Results: a table on stdout and JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang"))  # the CPU stand-ins of SGLang's CUDA-only module (test support)

from sglang_cpu_support import CPU_SERVER_ARGS, cpu_launch_env  # noqa: E402

from megatron_rl.config.sampling import SamplingParams  # noqa: E402
from megatron_rl.rollout.engines.local_engine import LocalEngine  # noqa: E402
from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine  # noqa: E402
from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServers  # noqa: E402
from megatron_rl.rollout.sglang.sync_paths import make_weight_sync  # noqa: E402
from megatron_rl.tiny_model import BENCH_SPEC, make_tiny_qwen3_moe  # noqa: E402

BROADCAST_HELPER = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=1, world_size=2)
buf = torch.empty(int(sys.argv[2]), dtype=torch.uint8)
for _ in range(int(sys.argv[3])):
    dist.broadcast(buf, src=0)
dist.destroy_process_group()
"""


def hf_buckets(model_dir: Path, bucket_mb: int) -> list[list[tuple[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    buckets, bucket, size = [], [], 0
    for name, tensor in tensors.items():
        bucket.append((name, tensor))
        size += tensor.nbytes
        if size >= bucket_mb << 20:
            buckets.append(bucket)
            bucket, size = [], 0
    return buckets + ([bucket] if bucket else [])


def rollout_tokens_per_s(engine, prompts: list[list[int]], params: SamplingParams, n: int) -> float:
    engine.generate(prompts[:1], params, n=1)  # warm-up
    start = time.perf_counter()
    samples = engine.generate(prompts, params, n=n)
    return sum(len(s.response_ids) for s in samples) / (time.perf_counter() - start)


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def raw_http_seconds(nbytes: int, posts: int) -> float:
    """POST `posts` bodies adding up to `nbytes` (base64-sized like the tensor path) to a local sink."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    body = b"x" * (nbytes * 4 // 3 // posts)  # the tensor path sends base64 text
    url = f"http://127.0.0.1:{server.server_address[1]}/sink"
    start = time.perf_counter()
    for _ in range(posts):
        urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=60).read()
    seconds = time.perf_counter() - start
    server.shutdown()
    return seconds


def raw_broadcast_seconds(nbytes: int, repeats: int) -> float:
    """Median seconds of one gloo broadcast of `nbytes` to a helper process."""
    from megatron_rl.rollout.sglang.sglang_server import free_port

    port = free_port()
    helper = subprocess.Popen([sys.executable, "-c", BROADCAST_HELPER, str(port), str(nbytes), str(repeats + 1)])
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    dist.broadcast(buf, src=0)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.broadcast(buf, src=0)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    helper.wait(timeout=60)
    return statistics.median(times)


def raw_disk_seconds(nbytes: int, directory: Path) -> float:
    data = os.urandom(nbytes)
    path = directory / "raw.bin"
    start = time.perf_counter()
    path.write_bytes(data)
    path.read_bytes()
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--sglang-python", default=str(ROOT / ".venv-sglang" / "bin" / "python"))
    args = parser.parse_args()
    # Bigger than the demo's model so that sync moves megabytes: ~25 MB of fp32 weights.
    work = Path(tempfile.mkdtemp(prefix="bench_rollout_sync_"))
    model = make_tiny_qwen3_moe(work / "model", BENCH_SPEC, seed=3)
    prompts = [[1, 10 + i % 100, 20 + i % 90, 5] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    local = LocalEngine(model)
    local_tps = rollout_tokens_per_s(local, prompts, params, args.n)
    local.shutdown()
    result: dict = {"rollout_tokens_per_s": {"local": local_tps}}
    config = SGLangLaunchConfig(model_path=str(model), python=args.sglang_python, extra_args=CPU_SERVER_ARGS,
                                env=cpu_launch_env(), log_dir=str(work / "logs"), startup_timeout_s=300)  # fmt: skip
    buckets = hf_buckets(model, args.bucket_mb)
    nbytes = sum(t.nbytes for b in buckets for _, t in b)
    with SGLangServers.launch(config) as servers:
        engine = SGLangEngine(servers, request_timeout_s=300, extra_sampling_params={"ignore_eos": True})
        result["rollout_tokens_per_s"]["sglang"] = rollout_tokens_per_s(engine, prompts, params, args.n)
        sync = {}
        for path in ("tensor", "distributed", "disk"):
            engine.weight_sync = make_weight_sync(path)
            times = []
            for i in range(args.repeats + 1):  # the first update also sets up (group, directory): not timed
                start = time.perf_counter()
                engine.update_weights(buckets, f"{path}-{i}")
                times.append(time.perf_counter() - start)
            sync[path] = statistics.median(times[1:])
            if path == "distributed":
                engine.weight_sync.close()
        engine.shutdown()
    raw = {
        "tensor": raw_http_seconds(nbytes, len(buckets)),
        "distributed": raw_broadcast_seconds(nbytes, args.repeats),
        "disk": raw_disk_seconds(nbytes, Path(tempfile.gettempdir())),
    }
    result["weight_sync"] = {
        p: {"bytes": nbytes, "seconds": sync[p], "raw_seconds": raw[p], "fraction_of_raw": raw[p] / sync[p]}
        for p in sync
    }
    print(f"rollout tokens/s: local {local_tps:.0f}, SGLang {result['rollout_tokens_per_s']['sglang']:.0f} "
          f"({args.prompts} prompts x {args.n} samples x {args.max_new_tokens} tokens)")  # fmt: skip
    print(f"weight sync of {nbytes / 2**20:.1f} MiB in {len(buckets)} buckets (median of {args.repeats}):")
    print(f"{'path':<13}{'seconds':>9}{'MiB/s':>9}{'raw s':>9}{'raw MiB/s':>11}{'of raw':>8}  budget >= 70%")
    for p, r in result["weight_sync"].items():
        print(f"{p:<13}{r['seconds']:>9.3f}{nbytes / r['seconds'] / 2**20:>9.1f}{r['raw_seconds']:>9.3f}"
              f"{nbytes / r['raw_seconds'] / 2**20:>11.1f}{r['fraction_of_raw']:>8.1%}  "
              f"{'met' if r['fraction_of_raw'] >= 0.7 else 'MISSED'}")  # fmt: skip
    date = datetime.date.today().isoformat()
    result = {"date": date, "machine": f"{os.uname().machine} CPU, {os.cpu_count()} cores",
              "command": "PYTHONPATH=. python benchmarks/bench_rollout_sync.py " + " ".join(sys.argv[1:]),
              **result}  # fmt: skip
    dest = ROOT / "benchmarks" / "results" / f"rollout_sync_{date}.json"
    dest.write_text(json.dumps(result, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
