"""The server is bounded and guarded: oversized bodies are refused before they are read, a request asks for a
bounded number of sequences, every malformed field is a 400 that names it, a constraint that cannot compile is
a 400 before any byte, a failure after a stream started is an error event, an API key guards every route but
/health, CORS answers only the origins allowed, and a client that leaves stops its requests. A fuzz run from the
server's own OpenAPI schema (slow set) finds no response of 500 or more."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from ead_llm import EntropyAdaptiveLLM, LargeOnly
from ead_llm.serving.cli import build_parser, serve_limits
from ead_llm.serving.server import ServerLimits, create_app, default_model_name
from ead_llm.testing.faults import fail_passes
from tests.serving.conftest import serve
from tests.tiny_pairs import chat_pair

LONG = 400


@pytest.fixture(scope="module")
def llm(llama_paths: tuple[Path, Path]) -> EntropyAdaptiveLLM:
    small, large = llama_paths
    return EntropyAdaptiveLLM(small=str(small), large=str(large), policy=LargeOnly(), max_tokens=8)


@pytest.fixture(scope="module")
def url(llm: EntropyAdaptiveLLM) -> Iterator[str]:
    limits = ServerLimits(max_request_bytes=4096, max_sequences=6)
    yield from serve(create_app(llm, limits=limits))


def raw_request(url: str, path: str, headers: dict[str, str], body: bytes) -> socket.socket:
    """An HTTP/1.1 POST written by hand on a socket (so that a test controls what is sent, and when it leaves)."""
    where = urlparse(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", f"Host: {where.hostname}", *[f"{k}: {v}" for k, v in headers.items()], "", ""]
    sock.sendall("\r\n".join(lines).encode() + body)
    return sock


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(url: str) -> None:
    sock = raw_request(url, "/v1/completions", {"Content-Type": "application/json", "Content-Length": "10000000"}, b"{")
    answer = sock.recv(65536).decode()  # answered while 9,999,999 bytes are still unsent
    sock.close()
    assert answer.startswith("HTTP/1.1 413")
    assert "over 4096 bytes" in answer


def test_a_chunked_body_over_the_limit_stops_being_read(url: str) -> None:
    sent = []

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(1000):  # 1 MB if it were all read
            sent.append(1)
            yield b"x" * 1000

    response = httpx.post(f"{url}/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "over 4096 bytes" in response.json()["error"]["message"]


def test_a_request_asks_for_a_bounded_number_of_sequences(url: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": ["1", "2", "3", "4"], "n": 2})
    assert response.status_code == 400
    assert "8 sequences (4 prompts x n=2)" in response.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": ["1", "2", "3"], "n": 2}).status_code == 200


USER = {"role": "user", "content": "1+1="}


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, "function"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]}, "tool_calls.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [1]}]}, "content"),
        (
            "/v1/chat/completions",
            {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": "x"}},
            "json_schema",
        ),
        ("/v1/chat/completions", {"messages": [USER], "tool_choice": {"function": "f"}}, "tool_choice"),
        ("/v1/chat/completions", {"messages": [USER], "tools": [{"function": {"name": 3}}]}, "tools.0.function.name"),
        ("/v1/chat/completions", {"messages": [USER], "stream_options": []}, "stream_options"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "1", "policy": {"policy": "eager", "decoder": 3}}, "policy"),
        ("/v1/completions", {"prompt": "1", "policy": {"policy": "ead", "window": [1]}}, "policy"),
        ("/v1/completions", {"prompt": "1", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "1", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "1", "max_tokens": 10**12}, "max_tokens"),
        ("/v1/completions", {"prompt": "1", "prompt_truncation": "middle"}, "prompt_truncation"),
    ],
)
def test_every_malformed_field_is_a_400_that_names_it(url: str, path: str, payload: dict, param: str) -> None:
    response = httpx.post(f"{url}{path}", json=payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in f"{error['param']} {error['message']}"


def test_malformed_json_is_a_400(url: str) -> None:
    for body in (b"{", b"[]", b'{"prompt": NaN}', b"\xff\xfe"):
        response = httpx.post(f"{url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (body, response.text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_cannot_compile_is_a_400_before_any_byte(url: str, stream: bool) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)b"}}}
    payload = {
        "messages": [USER],
        "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=payload)
    assert response.status_code == 400 and "look-around" in response.json()["error"]["message"]


def test_a_failure_after_a_stream_started_ends_it_with_an_error_event(url: str, llm: EntropyAdaptiveLLM) -> None:
    from openai import APIError, OpenAI

    prompt = "12+35="
    start = len(llm.shared_engine.encode(prompt))
    with fail_passes(llm.shared_engine, role="large", when=lambda ids: len(ids) >= start + 3):
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "stream": True}) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(APIError, match="injected fault"):
            for _ in client.completions.create(model=default_model_name(llm), prompt=prompt, stream=True):
                pass
    chunks = [json.loads(e) for e in events]
    assert len(chunks) >= 3 and all("choices" in c for c in chunks[:-1])  # the tokens before the fault came through
    assert chunks[-1]["error"]["type"] == "server_error" and "injected fault" in chunks[-1]["error"]["message"]


def test_an_api_key_guards_every_route_but_health(llm: EntropyAdaptiveLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAD_LLM_API_KEY", "s3cret")
    limits = serve_limits(build_parser().parse_args(["serve"]))
    assert limits.api_key == "s3cret"
    assert serve_limits(build_parser().parse_args(["serve", "--api-key", "other"])).api_key == "other"
    for url in serve(create_app(llm, limits=limits)):
        assert httpx.get(f"{url}/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/openapi.json")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                response = httpx.request(method, f"{url}{path}", json={"prompt": "1"}, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["type"] == "authentication_error"
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "1"}, headers=good).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200


def test_cors_answers_only_the_allowed_origins(llm: EntropyAdaptiveLLM) -> None:
    limits = ServerLimits(allowed_origins=("https://app.example.com",), api_key="k")
    for url in serve(create_app(llm, limits=limits)):
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = httpx.options(f"{url}/v1/completions", headers={"Origin": "https://app.example.com", **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
        other = httpx.options(f"{url}/v1/completions", headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
    for url in serve(create_app(llm)):  # no origins given: no CORS headers at all
        plain = httpx.get(f"{url}/health", headers={"Origin": "https://app.example.com"})
        assert "access-control-allow-origin" not in plain.headers


def test_clients_that_leave_stop_their_requests(llm: EntropyAdaptiveLLM) -> None:
    """Eight abandoned non-streamed requests of 400 tokens each: the engine stops them once the clients have
    gone, long before they would have finished (counted in engine steps, not seconds)."""
    engine = llm.shared_engine
    for url in serve(create_app(llm)):
        body = json.dumps({"prompt": "12+35=", "max_tokens": LONG, "n": 2, "ignore_eos": True}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        sockets = [raw_request(url, "/v1/completions", headers, body) for _ in range(4)]
        deadline = time.monotonic() + 60
        while engine.load["running"] < 8:
            assert time.monotonic() < deadline, engine.load
            time.sleep(0.002)
        for sock in sockets:
            sock.close()
        left_at = engine.steps
        while engine.load["running"] or engine.load["waiting"]:
            assert time.monotonic() < deadline, engine.load
            time.sleep(0.005)
        assert engine.steps - left_at < LONG // 2, f"{engine.steps - left_at} steps after the clients left"
        assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "1"}).status_code == 200  # serving on


FUZZ_MAX_TOKENS = 64
"""The fuzz caps the tokens a request may ask for: up to the tiny pair's 2,048-position context, one request ran 10-12
s on a quiet machine, past schemathesis's 10 s read timeout (a failure that said nothing about the server)."""
FUZZ_READ_TIMEOUT_S = 120


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:prompt characters outside the vocabulary")
def test_fuzzing_the_openapi_schema_finds_no_server_error() -> None:
    """Schema-valid and schema-violating requests generated from the server's own OpenAPI document, on a pair with
    a byte-level tokenizer and a chat template (so tools and response formats compile): every answer is below
    500, and the server answers normally afterwards."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    small, large = chat_pair()
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=8)
    app = create_app(llm, limits=ServerLimits(max_sequences=4))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[Any] = []
    statuses: dict[int, int] = {}
    answered = 0
    for path in ("/v1/completions", "/v1/chat/completions"):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = schema[path]["POST"].as_strategy(generation_mode=mode)

            @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=strategy)
            def run(case: Any) -> None:
                nonlocal answered
                if isinstance(case.body, dict):  # a valid request for the whole context takes seconds: cap its work
                    for key in ("max_tokens", "max_completion_tokens"):
                        value = case.body.get(key)
                        if type(value) is int and value > FUZZ_MAX_TOKENS:
                            case.body[key] = FUZZ_MAX_TOKENS
                response = case.call(timeout=FUZZ_READ_TIMEOUT_S)  # a hang fails; a slow machine does not
                answered += 1
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    failures.append((case.path, case.body, response.status_code, response.text[:300]))

            run()
    assert answered >= 500 and statuses.get(200, 0) >= 50, statuses  # valid requests ran, invalid ones were refused
    assert failures == []
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "1"}).status_code == 200
    assert llm.shared_engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


def test_limits_refuse_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_sequences"):
        ServerLimits(max_sequences=0)
    with pytest.raises(ValueError, match="api_key"):
        ServerLimits(api_key=" ")
    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerLimits(max_request_bytes=-1)
    assert ServerLimits().body_limit(8192) == 2**20 and ServerLimits().body_limit(2**16) == 2**21
