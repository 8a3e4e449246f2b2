"""The server's tools, tool_choice and response_format, spoken to by the official ``openai`` client and by
LangChain's ``ChatOpenAI(...).bind_tools(...)`` over real HTTP (a tiny random pair: forced calls and
formats parse because the grammar enforces them)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from ead_llm import EntropyAdaptiveLLM
from ead_llm.serving.server import create_app
from tests.adapters.test_tools import pair
from tests.serving.conftest import serve

MODEL = "tiny"
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"]},
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"enum": ["Ada", "Alan"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    small, large = pair()
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=80)
    yield from serve(create_app(llm, MODEL))


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_gets_a_required_tool_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        tools=[ADD, WEATHER],
        tool_choice="required",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("add", "weather") and call.id.startswith("call_")
        assert set(arguments) == ({"a", "b"} if call.function.name == "add" else {"city"})
    assert choice.message.tool_calls and reply.usage.completion_tokens > 0


def test_a_named_tool_round_trips_with_its_reply(client: openai.OpenAI) -> None:
    messages: list = [{"role": "user", "content": "Weather in Lima?"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[ADD, WEATHER],
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Lima")
    messages += [
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    follow = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD, WEATHER], tool_choice="none")
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_arrive_as_deltas_under_one_id(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "2+3?"}],
        "tools": [ADD],
        "tool_choice": "required",
    }
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert len({c.id for c in chunks}) == 1
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (t.function.name, t.function.arguments) for t in whole
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("strict", [True, False])
def test_response_format_json_schema_and_json_object(client: openai.OpenAI, strict: bool) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}},
    )
    text = reply.choices[0].message.content or ""
    if strict or reply.choices[0].finish_reason == "stop":  # not strict: a random model may add keys to the limit
        person = json.loads(text)
        assert person["name"] in ("Ada", "Alan") and 0 <= person["age"] <= 99
    else:
        assert text.startswith('{"name":"A')
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "{}"}],
        response_format={"type": "json_object"},
        max_tokens=60,
    )
    text = obj.choices[0].message.content or ""
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":  # any object: a random model may still be inside it at the limit
        assert isinstance(json.loads(text), dict)


def test_langchain_chat_openai_binds_tools_against_it(url: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0, max_retries=0)
    message = chat.bind_tools([ADD, WEATHER], tool_choice="add").invoke("What is 2 + 3?")
    assert [c["name"] for c in message.tool_calls] == ["add"]
    assert set(message.tool_calls[0]["args"]) == {"a", "b"}
    streamed = None
    for chunk in chat.bind_tools([ADD, WEATHER], tool_choice="add").stream("What is 2 + 3?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"tools": [{"x": 1}]}, "tools.0.function"),
        ({"tools": [ADD], "tool_choice": "subtract"}, "tool_choice"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema must be"),
        ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_get_a_400_that_names_the_field(url: str, payload: dict, needle: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **payload}
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_a_folder_pair_gets_a_short_model_id_and_the_long_one_still_works(url: str) -> None:
    from ead_llm.serving.server import default_model_name

    small, large = pair()
    assert default_model_name(EntropyAdaptiveLLM(small=small, large=large)) == "ead-llm/large"
    assert default_model_name(EntropyAdaptiveLLM()) == "ead-llm/embedded"
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ids == [MODEL]
    long_form = f"ead-llm/{small}+{large}"
    body = {"model": long_form, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200


def test_max_tokens_beyond_the_context_is_a_400_naming_the_limit(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "context is 2048 tokens" in error["message"]
    assert "lower max_tokens to at most" in error["message"]
    completion = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5000})
    assert completion.status_code == 400 and "context is 2048" in completion.json()["error"]["message"]


def test_serve_prices_put_cost_usd_in_usage() -> None:
    from ead_llm.serving.cli import build_parser, serve_pricing
    from ead_llm.serving.server import Server

    args = build_parser().parse_args(["serve", "--price-large-output", "4", "--price-small-input", "0.05"])
    pricing = serve_pricing(args)
    assert pricing is not None and (pricing.large_output, pricing.small_input, pricing.small_output) == (4.0, 0.05, 0.0)
    assert pricing.large_cached_input is None  # cached positions pay the input price unless priced
    cached = serve_pricing(build_parser().parse_args(["serve", "--price-large-cached-input", "0.1"]))
    assert cached is not None and (cached.large_cached_input, cached.large_input, cached.small_cached_input) == (
        0.1,
        0.0,
        None,
    )
    assert serve_pricing(build_parser().parse_args(["serve"])) is None
    small, large = pair()
    server = Server(EntropyAdaptiveLLM(small=small, large=large, max_tokens=4, pricing=pricing), MODEL)
    from ead_llm.serving.server import CompletionBody

    job = server.completions(CompletionBody(prompt="x"))
    reply = job.respond(*server.llm._run(job.requests))
    assert reply["usage"]["cost_usd"] > 0
