"""`ead-llm serve`: real HTTP on 127.0.0.1, spoken to by httpx, curl, LangChain's ChatOpenAI and DSPy via LiteLLM."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator

import dspy
import httpx
import pytest

from ead_llm import EntropyAdaptiveLLM
from ead_llm.evaluation.task import problems
from ead_llm.serving.server import create_app
from tests.serving.conftest import serve

PROMPT = problems("test", 1)[0].prompt
MODEL = "ead-llm/embedded"


@pytest.fixture(scope="module")
def llm() -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM(max_tokens=200)


@pytest.fixture(scope="module")
def url(llm: EntropyAdaptiveLLM) -> Iterator[str]:
    yield from serve(create_app(llm))


def test_health_and_models(url: str) -> None:
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["running"] == 0
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_completions_match_the_library_and_bill_in_usage(url: str, llm: EntropyAdaptiveLLM) -> None:
    body = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [PROMPT, "1234+5678-999\n"]}).json()
    assert [c["text"] for c in body["choices"]] == [llm.invoke(PROMPT), llm.invoke("1234+5678-999\n")]
    usage = body["usage"]
    expected = llm.generate([PROMPT, "1234+5678-999\n"]).llm_output["cost"]  # type: ignore[index]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens", "large_tokens", "flops", "switches"):
        assert usage[key] == expected[key], key
    sampled = httpx.post(
        f"{url}/v1/completions", json={"prompt": PROMPT, "n": 3, "temperature": 1.5, "policy": {"policy": "small_only"}}
    ).json()
    texts = [c["text"] for c in sampled["choices"]]
    assert len(set(texts)) > 1 and sampled["usage"]["large_tokens"] == 0


def test_streaming_chat_sends_tokens_then_usage(url: str, llm: EntropyAdaptiveLLM) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    payload["stream_options"] = {"include_usage": True}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == llm.invoke(PROMPT)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(chunks) - 1
    assert {c["ead_model"] for c in chunks if c["choices"]} <= {"S", "L"}
    assert len({c["id"] for c in chunks}) == 1  # one id per completion, the usage chunk included, as OpenAI


def test_langchain_chat_openai_talks_to_it(url: str, llm: EntropyAdaptiveLLM) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0, max_retries=0)
    reply = chat.invoke(PROMPT)
    assert reply.content == llm.invoke(PROMPT)
    text_tokens = llm.shared_engine.tokenizer.encode(llm.invoke(PROMPT), add_special_tokens=False)
    assert reply.usage_metadata["output_tokens"] == len(text_tokens) + 1  # + EOS
    assert "".join(str(c.content) for c in chat.stream(PROMPT)) == reply.content


def test_dspy_through_litellm_talks_to_it(url: str, llm: EntropyAdaptiveLLM) -> None:
    remote = dspy.LM(f"openai/{MODEL}", api_base=f"{url}/v1", api_key="unused", engine="litellm", cache=False)
    assert remote(PROMPT, temperature=0.0) == [llm.invoke(PROMPT)]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(url: str, llm: EntropyAdaptiveLLM) -> None:
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 20})
    done = subprocess.run(
        ["curl", "-s", "-X", "POST", f"{url}/v1/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    reply = json.loads(done.stdout)
    assert reply["choices"][0]["text"] == llm.invoke(PROMPT, max_tokens=20)
    assert reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "payload", "status", "needle"),
    [
        ("/v1/completions", {"model": "gpt-4o", "prompt": "1"}, 404, "not served here"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "1"}], "tools": [{"x": 1}]},
            400,
            "tools.0.function",
        ),
        ("/v1/completions", {"prompt": "1", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "1", "policy": {"policy": "ead", "threshold": -2}}, 400, "threshold"),
        ("/v1/completions", {"prompt": "1", "n": 0}, 400, "n: Input should be greater than or equal to 1"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_get_clear_errors(url: str, path: str, payload: dict, status: int, needle: str) -> None:
    response = httpx.post(f"{url}{path}", json=payload)
    assert response.status_code == status
    assert needle in response.json()["error"]["message"]
    assert httpx.get(f"{url}/health").json()["running"] == 0


def test_the_serve_command_starts_a_server(tmp_path) -> None:
    import socket
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "ead_llm.serving.cli", "serve", "--port", str(port), "--max-batch", "8"]
    command += ["--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            pytest.fail(f"server did not start: {process.stderr.read() if process.stderr else ''}")
        assert health["status"] == "ok" and health["model"] == MODEL
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": PROMPT}, timeout=60).json()
        assert reply["choices"][0]["text"] == EntropyAdaptiveLLM(max_tokens=256).invoke(PROMPT)
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_a_bad_streamed_request_gets_an_error_status_before_any_byte(url: str, llm: EntropyAdaptiveLLM) -> None:
    too_long = "1" * (llm.shared_engine.max_positions or 0 + 10)
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": too_long, "stream": True}) as response:
        assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
        assert "prompt has" in json.loads(response.read())["error"]["message"]
    voting = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": PROMPT}], "stream": True, "policy": {"policy": "eager"}},
    )
    assert voting.status_code == 400 and "vote" in voting.json()["error"]["message"]
    assert httpx.get(f"{url}/health").json()["running"] == 0
