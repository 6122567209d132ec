"""A reference reward service for the `remote` reward (megatron_rl/rollout/rewards/remote.py has the JSON contract).

It scores 1.0 when the response's final number (gsm8k's convention: after the last `####`, else the last number;
`1,000` = `1000.0`) equals the sample's answer, else 0.0 (also when the answer is null).

    python examples/reward_server.py --port 8000 [--api-key-file key.txt]
    megatron-rl train my.yaml 'data.reward={name: remote, options: {url: "http://127.0.0.1:8000/score"}}'

POST /score  {"samples": [{"prompt", "response", "answer", "metadata"}, ...]}  ->  {"rewards": [1.0, 0.0, ...]}
GET /stats   {"requests": POSTs received, "samples": samples scored}

With --api-key-file, a request without `Authorization: Bearer <the file's token>` is answered 401. The fault flags
let tests play a flaky or hung service: --fail-first N answers the first N POSTs 503, --hang-after N answers N POSTs
and then never answers (--hang: from the first). It prints `listening on http://127.0.0.1:PORT` when ready
(--port 0 picks a free port).
"""

from __future__ import annotations

import argparse
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from megatron_rl.rollout.rewards.math_rewards import gsm8k


def score(sample: dict[str, Any]) -> float:
    """gsm8k's exact match of the final number against the sample's answer; 0.0 without an answer."""
    answer = sample.get("answer")
    if answer is None:
        return 0.0
    return gsm8k(None, str(sample["response"]), {"answer": answer})  # type: ignore[arg-type]


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True  # a hung handler never blocks the exit

    def __init__(self, port: int, token: str | None, fail_first: int, hang_after: int | None):
        super().__init__(("127.0.0.1", port), Handler)
        self.token, self.fail_first, self.hang_after = token, fail_first, hang_after
        self.lock = threading.Lock()
        self.requests = 0  # POSTs received, faults included
        self.samples = 0  # samples scored


class Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path != "/stats":
            self._reply(404, {"error": "GET /stats or POST /score"})
            return
        with self.server.lock:
            self._reply(200, {"requests": self.server.requests, "samples": self.server.samples})

    def do_POST(self) -> None:  # noqa: N802
        server = self.server
        with server.lock:
            server.requests += 1
            number = server.requests
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if server.token is not None and not hmac.compare_digest(
            self.headers.get("Authorization", ""), f"Bearer {server.token}"
        ):
            self._reply(401, {"error": "missing or wrong bearer token"})
            return
        if server.hang_after is not None and number > server.hang_after:
            threading.Event().wait()  # a hung service: never answers
        if number <= server.fail_first:
            self._reply(503, {"error": f"simulated outage ({number} of the first {server.fail_first} requests)"})
            return
        try:
            samples = json.loads(body)["samples"]
            rewards = [score(s) for s in samples]
        except (ValueError, KeyError, TypeError) as err:
            self._reply(400, {"error": f"expected {{'samples': [{{prompt, response, answer, metadata}}]}}: {err}"})
            return
        with server.lock:
            server.samples += len(samples)
        self._reply(200, {"rewards": rewards})

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # quiet: one line per request would drown the trainer's output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--api-key-file", help="answer 401 unless the request has 'Authorization: Bearer <token>'")
    parser.add_argument("--fail-first", type=int, default=0, metavar="N", help="answer the first N POSTs 503")
    parser.add_argument("--hang-after", type=int, metavar="N", help="answer N POSTs, then never answer")
    parser.add_argument("--hang", action="store_const", const=0, dest="hang_after", help="never answer a POST")
    args = parser.parse_args()
    token = Path(args.api_key_file).read_text(encoding="utf-8").strip() if args.api_key_file else None
    server = RewardServer(args.port, token, args.fail_first, args.hang_after)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
