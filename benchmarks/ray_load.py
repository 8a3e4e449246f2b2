"""Load test of `ead-llm serve`: the plain server against Ray Serve with 1 and 2 replicas, loopback only.

Each configuration serves the embedded pair (EAD, its threshold) on 127.0.0.1 in processes of its own
(the plain server: `ead-llm serve`; Ray: a local cluster, `ead_llm.serving.ray`), every process with
OMP_NUM_THREADS=1. Then:

- one client, requests one after another (``--single`` of them): the median latency, whose difference
  from the plain server's is Ray's added latency per request (its HTTP proxy, the router, the hop to the
  replica);
- ``--clients`` concurrent clients (32) sending ``--requests`` each: throughput (requests/s, tokens/s)
  and p50/p99 latency.

On a 2-core machine two replicas share the same two cores (and the proxy and controller take some), so
the figures show Ray's overhead, not scaling; scaling needs a core or a GPU per replica.

    python benchmarks/ray_load.py [--clients 32] [--requests 4] [--single 20] [--max-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

PROMPTS = ["4821+3907-1568\n", "1234+5678-999\n", "9876-5432+1111\n", "3141+2718-1000\n"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, bound_s: float = 300.0) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up within {bound_s} s")


def start(kind: str, replicas: int, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kind == "plain":
        cmd = ["ead-llm", "serve", "--port", str(port), "--log-level", "warning"]
    else:
        cmd = ["ead-llm", "serve", "--port", str(port), "--replicas", str(replicas), "--num-cpus", "0.5"]
        if replicas == 1:
            cmd += ["--min-replicas", "1", "--max-replicas", "1"]  # Ray with one replica (plain 1 means no Ray)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop(process: subprocess.Popen[bytes]) -> None:
    import signal

    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    if "ray" in " ".join(map(str, process.args)):
        subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False)


def one(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    start_s = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=300)
    response.raise_for_status()
    return time.perf_counter() - start_s, int(response.json()["usage"]["completion_tokens"])


def measure(url: str, clients: int, requests: int, single: int, max_tokens: int) -> dict[str, Any]:
    with httpx.Client() as client:
        for prompt in PROMPTS:  # warm every replica a little
            one(client, url, prompt, max_tokens)
        alone = [one(client, url, PROMPTS[i % len(PROMPTS)], max_tokens)[0] for i in range(single)]
    results: list[tuple[float, int]] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        with httpx.Client() as own:
            for i in range(requests):
                got = one(own, url, PROMPTS[(k + i) % len(PROMPTS)], max_tokens)
                with lock:
                    results.append(got)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    latencies = sorted(r[0] for r in results)
    return {
        "single_p50_ms": 1e3 * statistics.median(alone),
        "concurrent_requests": len(results),
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r[1] for r in results) / wall,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--single", type=int, default=20, help="sequential requests for the latency overhead")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"clients": args.clients, "requests_per_client": args.requests, "cpus": os.cpu_count()}
    for name, kind, replicas in (("plain", "plain", 1), ("ray_1_replica", "ray", 1), ("ray_2_replicas", "ray", 2)):
        port = free_port()
        process = start(kind, replicas, port)
        try:
            wait_ready(f"http://127.0.0.1:{port}")
            report[name] = measure(
                f"http://127.0.0.1:{port}", args.clients, args.requests, args.single, args.max_tokens
            )
        finally:
            stop(process)
        print(name, json.dumps({k: round(v, 2) for k, v in report[name].items()}), flush=True)
    added = report["ray_1_replica"]["single_p50_ms"] - report["plain"]["single_p50_ms"]
    report["ray_added_latency_ms"] = added
    print(f"Ray's added latency per request (median, one client): {added:.1f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
