"""Latency and throughput of `tmt serve` on a run: start the server, send requests from concurrent
clients (each a closed loop on a kept-alive connection), and report per-request latency (p50, p99)
and sentences per second for each client count, with how the server batched them (`GET /health`).

    OMP_NUM_THREADS=1 python benchmarks/serve.py --run runs/demo                  # 1 and 8 clients
    python benchmarks/serve.py --run runs/demo --clients 1,4,16 --beam 5 --max-wait-ms 20

`--bench-model cpu-small` serves instead the model `benchmarks/decode.py` times: its preset's
dimensions, random weights, BPE trained on the demo corpus, written as a run in a temporary folder
(a random model seldom ends a sentence: each runs to the length cap, more work than a trained one).

Sentences are the demo corpus's test split (or `--input`), one per request unless
`--sentences-per-request` says more, cycled until `--requests` requests were answered; a few
requests warm the server up first. The last line of output is one JSON object with every figure.

`--huge-body-mb N` then sends one request of a single N-MB sentence (announcing its length, as curl
does, and sending all of it) and, while it is under way, asks `GET /health` and translates one
sentence again and again on other connections: their latencies say whether the huge request stalls
the server for everyone else.

    OMP_NUM_THREADS=1 python benchmarks/serve.py --run runs/demo --clients 1 --huge-body-mb 20"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from common import DECODE_PRESETS, DEMO_CORPUS, build_run, checkout_env, cpu_name

DEMO_TEST = DEMO_CORPUS / "test.en"


def start_server(run: Path, options: list[str]) -> tuple[subprocess.Popen, str]:
    """`tmt serve --run RUN --port 0 OPTIONS` and the URL it serves at."""
    env = checkout_env()
    process = subprocess.Popen([sys.executable, "-m", "transformer_mt", "serve", "--run", str(run), "--port", "0",
                                *options], stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:  # all of stderr, so that the pipe never fills
        for line in process.stderr:
            lines.append(line)
            if "serving" in line:
                started.set()
        started.set()

    threading.Thread(target=read, daemon=True).start()
    if not started.wait(600) or process.poll() is not None:
        raise SystemExit("bench_serve: tmt serve did not start:\n" + "".join(lines))
    print(lines[-1].rstrip(), file=sys.stderr)
    return process, re.search(r"at (http://\S+/);", "".join(lines)).group(1)


class Client:
    """One kept-alive HTTP connection to the server."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        self.connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = self.connection.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise SystemExit(f"bench_serve: {method} {path} answered {response.status}: {answer}")
        return answer


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linearly interpolated between the two closest ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def measure(url: str, requests: list[list[str]], clients: int, options: dict) -> dict:
    """Send `requests` from `clients` threads at once, each taking the next request when answered."""
    latencies: list[float] = []
    lock = threading.Lock()
    position = iter(range(len(requests)))
    before = Client(url).call("GET", "/health")

    def work() -> None:
        client = Client(url)
        while True:
            with lock:
                i = next(position, None)
            if i is None:
                return
            start = time.perf_counter()
            client.call("POST", "/translate", {"sentences": requests[i], **options})
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)

    threads = [threading.Thread(target=work) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    after = Client(url).call("GET", "/health")
    sentences = sum(map(len, requests))
    batches = after["batches"] - before["batches"]
    return {"clients": clients, "requests": len(requests), "sentences": sentences, "wall_s": round(wall, 3),
            "sentences_per_s": round(sentences / wall, 1), "p50_ms": round(1000 * percentile(latencies, 50), 1),
            "p99_ms": round(1000 * percentile(latencies, 99), 1), "batches": batches,
            "requests_per_batch": round(len(requests) / batches, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, help="the run to serve")
    source.add_argument("--bench-model", metavar="PRESET", choices=sorted(DECODE_PRESETS),
                        help="serve a random model of this benchmarks/decode.py preset")
    parser.add_argument("--input", type=Path, default=DEMO_TEST, help="sentences, one a line (default: the demo "
                                                                       "corpus's test.en)")
    parser.add_argument("--requests", type=int, default=400, help="requests per client count (default 400)")
    parser.add_argument("--clients", default="1,8", help="comma-separated client counts (default 1,8)")
    parser.add_argument("--sentences-per-request", type=int, default=1, help="default 1")
    parser.add_argument("--beam", type=int, help="each request's beam_size (default: the run's)")
    parser.add_argument("--max-wait-ms", help="passed to tmt serve")
    parser.add_argument("--batch-tokens", help="passed to tmt serve")
    parser.add_argument("--engine", help="passed to tmt serve")
    parser.add_argument("--max-body-bytes", help="passed to tmt serve")
    parser.add_argument("--huge-body-mb", type=float, help="then time other requests while one of this many MB is "
                                                           "sent")
    args = parser.parse_args()
    sentences = [line.strip() for line in args.input.read_text(encoding="utf-8").splitlines() if line.strip()]
    per = args.sentences_per_request
    requests = [[sentences[(i * per + k) % len(sentences)] for k in range(per)] for i in range(args.requests)]
    options = [] + (["--max-wait-ms", args.max_wait_ms] if args.max_wait_ms else []) + \
        (["--batch-tokens", args.batch_tokens] if args.batch_tokens else []) + \
        (["--engine", args.engine] if args.engine else []) + \
        (["--max-body-bytes", args.max_body_bytes] if args.max_body_bytes else [])
    with tempfile.TemporaryDirectory() as folder:
        run = args.run or bench_model_run(Path(folder) / "bench", args.bench_model)
        server, url = start_server(run, options)
        results, health, huge = run_clients(url, server, requests, args)
    print(f"{'clients':>7} {'sentences/s':>11} {'p50 ms':>8} {'p99 ms':>8} {'requests/batch':>14}")
    for result in results:
        print(f"{result['clients']:>7} {result['sentences_per_s']:>11} {result['p50_ms']:>8} {result['p99_ms']:>8} "
              f"{result['requests_per_batch']:>14}")
    if huge:
        print(f"a {huge['body_mb']} MB request: {huge['status']} after {huge['answered_s']} s "
              f"({huge['error']}); meanwhile {huge['probes']} /health + translate probes, slowest "
              f"{huge['slowest_health_ms']} ms and {huge['slowest_translate_ms']} ms")
    print(json.dumps({"run": str(args.run or f"benchmarks/decode.py --preset {args.bench_model}"),
                      "checkpoint": health["checkpoint"], "step": health["step"],
                      "engine": health["engine"], "device": health["device"],
                      "beam": args.beam or health["beam_size"], "sentences_per_request": per,
                      "server_options": options, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                      "cpu": cpu_name(), "cores": os.cpu_count(),
                      "load_average": [round(x, 2) for x in os.getloadavg()], "results": results,
                      **({"huge_body": huge} if huge else {})}))


def bench_model_run(run_dir: Path, preset: str) -> Path:
    """A run directory holding decode.py's random model of `preset` (its default corpus and seed)."""
    run_dir.mkdir(parents=True)
    build_run(run_dir, preset)
    return run_dir


def run_clients(url: str, server: subprocess.Popen, requests: list[list[str]],
                args) -> tuple[list[dict], dict, dict | None]:
    """Warm the server up, measure each client count (and the huge request), stop the server; the
    results, its health and the huge request's figures."""
    try:
        body = {"beam_size": args.beam} if args.beam else {}
        warm = Client(url)
        for request in requests[:10]:
            warm.call("POST", "/translate", {"sentences": request, **body})
        health = warm.call("GET", "/health")
        results = [measure(url, requests, int(clients), body) for clients in args.clients.split(",")]
        huge = huge_request(url, args.huge_body_mb, requests[0]) if args.huge_body_mb else None
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(600)
    return results, health, huge


def huge_request(url: str, megabytes: float, probe: list[str]) -> dict:
    """Send one request of a single `megabytes`-MB sentence; meanwhile, on other connections, time
    `GET /health` and a translation of `probe` until it is answered (at least 20 of each)."""
    sentence = ("station " * int(megabytes * 1e6 / 8 + 1))[: int(megabytes * 1e6)]
    data = json.dumps({"sentences": [sentence]}).encode()
    answer: dict = {}

    def send() -> None:
        parts = urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        start = time.perf_counter()
        connection.request("POST", "/translate", body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        answer.update(status=response.status, error=json.loads(response.read()).get("error"),
                      answered_s=round(time.perf_counter() - start, 3))

    health, translate = [], []
    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive() or len(health) < 20:  # each probe on a new connection, as a new client's
        start = time.perf_counter()
        Client(url).call("GET", "/health")
        health.append(time.perf_counter() - start)
        start = time.perf_counter()
        Client(url).call("POST", "/translate", {"sentences": probe})
        translate.append(time.perf_counter() - start)
    sender.join()
    return {"body_mb": megabytes, "body_bytes": len(data), **answer, "probes": len(health),
            "slowest_health_ms": round(1000 * max(health), 1), "slowest_translate_ms": round(1000 * max(translate), 1),
            "p50_health_ms": round(1000 * percentile(health, 50), 1),
            "p50_translate_ms": round(1000 * percentile(translate, 50), 1)}


if __name__ == "__main__":
    main()
