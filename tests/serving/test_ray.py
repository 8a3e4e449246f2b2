"""`ead-llm serve` on Ray Serve: a local Ray cluster with 2 replicas of the embedded pair on this machine.

Requests spread over both replicas (four concurrent senders too); the bill, streaming, per-request policies
and seeds are those of one server; a killed replica's requests get 503 with Retry-After, it is replaced, and
a client that retries (the documented contract) loses nothing; a cancelled stream frees its sequence;
shutdown leaves no Ray process; SIGTERM stops `ead-llm serve --replicas 2` with status 0. Skipped where Ray Serve is not
installed (``pip install 'ead-llm[ray]'``; CI installs it).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'ead-llm[ray]'")

import ray
from ray import serve

from ead_llm import EntropyAdaptiveLLM
from ead_llm.serving.ray import (
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    REPLICA_HEADER,
    deployment,
    local_cluster_environment,
    run,
)

pytestmark = pytest.mark.slow  # a local cluster takes 30-60 s to start: CI runs these after the README's suite

PROMPT = "4821+3907-1568\n"
BOUND_S = 180.0
"""Longest wait for the cluster to reach a state (replicas replaced, sequences freed): a bound, not a timing."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ray_processes() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmd = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in cmd for mark in ("raylet", "gcs_server", "ray::", "default_worker.py")):
            found.append(cmd[:120])
    return found


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = _free_port()
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # before the cluster starts: its proxy inherits it
    local_cluster_environment()  # and a proxy that a busy machine does not get killed
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    run(deployment({"max_tokens": 200}, replicas=2, num_cpus=0.5), port=port, blocking=False)
    yield f"http://127.0.0.1:{port}"
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def llm() -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM(max_tokens=200)


def _complete(url: str, body: dict, retries: int = 0) -> httpx.Response:
    """POST a completion; with ``retries``, retry what a dying replica dropped (the client's contract)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            if response.status_code < 500 or retries == 0:
                return response
        except httpx.TransportError:
            if retries == 0:
                raise
        retries -= 1
        if time.monotonic() > deadline:
            raise AssertionError("no live replica answered within the bound")
        time.sleep(0.5)


def test_requests_spread_over_both_replicas_with_one_servers_text_and_bill(url: str, llm) -> None:
    expected = llm.generate([PROMPT])
    text, cost = expected.generations[0][0].text, expected.llm_output["cost"]
    replicas = set()
    for _ in range(20):  # power of two choices among idle replicas: both are chosen (all but certainly)
        response = _complete(url, {"prompt": PROMPT, "max_tokens": 200, "seed": 0})
        assert response.status_code == 200
        replicas.add(response.headers[REPLICA_HEADER])
        reply = response.json()
        assert reply["choices"][0]["text"] == text  # a seeded greedy request: the same text on any replica
        usage = reply["usage"]
        for key in ("completion_tokens", "small_tokens", "large_tokens", "switches", "flops", "large_fraction"):
            assert usage[key] == cost[key], key
    assert len(replicas) == 2


def test_four_concurrent_senders_spread_over_both_replicas(url: str) -> None:
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def sender(k: int) -> None:
        with httpx.Client(timeout=120) as client:  # keep-alive, as OpenAI's client
            for i in range(15):
                body = {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "seed": k * 100 + i}
                response = client.post(f"{url}/v1/completions", json=body)
                assert response.status_code == 200
                with lock:
                    counts[response.headers[REPLICA_HEADER]] += 1

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(counts.values()) == 60 and len(counts) == 2
    assert max(counts.values()) <= 39, counts  # no replica above 65%


def test_per_request_policy_and_streaming_through_ray(url: str, llm) -> None:
    reply = _complete(url, {"prompt": PROMPT, "max_tokens": 200, "policy": {"policy": "large"}}).json()
    assert reply["usage"]["large_fraction"] == 1.0
    chunks = []
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": 200}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == llm.invoke(PROMPT) and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == len(chunks)


def _loads(url: str) -> set[tuple[str, int]]:
    """(replica, running + waiting) of whichever replicas answer a burst of health checks."""
    seen = {}
    for _ in range(12):
        response = httpx.get(f"{url}/health", timeout=30)
        load = response.json()
        seen[response.headers[REPLICA_HEADER]] = load["running"] + load["waiting"]
    return set(seen.items())


def test_a_cancelled_stream_frees_its_sequence_on_its_replica(url: str) -> None:
    body = {"prompt": PROMPT, "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the stream is live; leaving the block drops the connection
    deadline = time.monotonic() + BOUND_S
    while any(load for _, load in _loads(url)):
        assert time.monotonic() < deadline, "the cancelled sequence was never freed"
        time.sleep(0.5)


def test_a_killed_replicas_requests_get_503_and_retried_requests_all_succeed(url: str, llm) -> None:
    text = llm.invoke(PROMPT)
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ead-llm" in a["name"]]
    replicas = [a for a in actors if "SERVE_REPLICA" in a["name"]]
    assert len(replicas) == 2
    answers: list[httpx.Response] = []

    def long_request() -> None:
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
        answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120))

    senders = [threading.Thread(target=long_request) for _ in range(4)]
    for sender in senders:
        sender.start()
    deadline = time.monotonic() + BOUND_S
    while True:  # a health check goes to the less busy replica: busy too, it holds some of the requests
        health = httpx.get(f"{url}/health", timeout=30)
        if health.json()["running"]:
            break
        assert time.monotonic() < deadline, "the requests never reached a replica"
    victim = next(a for a in replicas if a["name"].endswith(health.headers[REPLICA_HEADER]))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    for sender in senders:
        sender.join()
    statuses = sorted(a.status_code for a in answers)
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses  # never Serve's bare 500
    for answer in answers:
        if answer.status_code == 503:
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["code"] == "replica_unavailable"
    for _ in range(6):  # some of these reach the dead replica first: the client retries, as documented
        reply = _complete(url, {"prompt": PROMPT, "max_tokens": 200}, retries=20).json()
        assert reply["choices"][0]["text"] == text
    killed = victim["name"]
    deadline = time.monotonic() + BOUND_S
    while True:  # a new replica, not the killed one, and two running
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]}
        status = serve.status().applications["ead-llm"].deployments["ead-llm"]
        if killed not in names and len(names) == 2 and status.replica_states.get("RUNNING", 0) == 2:
            break
        assert time.monotonic() < deadline, f"the replica was not replaced: {names}, {status.replica_states}"
        time.sleep(0.5)
    served = {_complete(url, {"prompt": "1+1\n", "max_tokens": 4}).headers[REPLICA_HEADER] for _ in range(20)}
    assert len(served) == 2 and killed.split("#")[-1] not in served  # both live replicas answer


def test_shutdown_leaves_no_ray_process(url: str) -> None:
    serve.shutdown()
    ray.shutdown()
    deadline = time.monotonic() + BOUND_S
    while _ray_processes():
        assert time.monotonic() < deadline, f"left running: {_ray_processes()}"
        time.sleep(0.5)


def test_the_cli_builds_the_deployment_it_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import ead_llm.serving.ray as ray_serving
    from ead_llm.serving.cli import main

    built: list = []
    monkeypatch.setattr(ray_serving, "run", lambda app, **kw: built.append((app, kw)))
    assert main(["serve", "--replicas", "2", "--num-cpus", "0.5", "--port", "8123", "--policy", "large"]) == 0
    ((app, options),) = built
    deployment_ = app._bound_deployment
    assert deployment_.num_replicas == 2 and deployment_.ray_actor_options == {"num_cpus": 0.5}
    assert deployment_.max_ongoing_requests == 64 and options["port"] == 8123
    assert main(["serve", "--min-replicas", "1", "--max-replicas", "3", "--num-gpus", "1"]) == 0
    scaling = built[-1][0]._bound_deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 32.0)


@pytest.mark.slow
def test_sigterm_stops_serve_with_replicas_cleanly(tmp_path) -> None:
    """`ead-llm serve --replicas 2` in a process of its own: SIGTERM ends it with status 0 (Ray's own handler
    would abort it) and leaves no Ray process."""
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if key != PROXY_CALLBACK_ENV}
    command = [sys.executable, "-m", "ead_llm.serving.cli", "serve", "--port", str(port), "--replicas", "2"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen([*command, "--num-cpus", "0.5"], env=env, stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + BOUND_S
        while True:
            assert process.poll() is None, log.read_text(errors="replace")[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve never came up"
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=BOUND_S) == 0, log.read_text(errors="replace")[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    while _ray_processes():
        assert time.monotonic() < deadline + BOUND_S, f"left running: {_ray_processes()}"
        time.sleep(0.5)
