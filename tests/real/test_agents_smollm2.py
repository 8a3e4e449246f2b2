"""The agent recipes of ``integrations/agents_smollm2.py`` on SmolLM2: each finishes (a loop would hit the
recursion limit and raise), with the object, the calls it means, or fields DSPy's default adapter parses."""

from __future__ import annotations

import json

import pytest
from langchain_core.exceptions import OutputParserException

from integrations import agents_smollm2 as recipes

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # about 4 minutes on 2 cores


@pytest.fixture(scope="module")
def model(real_paths: object) -> object:
    return recipes.chat()


@pytest.mark.parametrize("policy", list(recipes.POLICIES))
def test_structured_agents_finish_with_the_object(model: object, policy: str) -> None:
    results = recipes.structured_agents(model.bind(policy=recipes.POLICIES[policy]))  # type: ignore[attr-defined]
    for name in ("auto", "tool", "provider", "react"):
        person = results[name]
        assert isinstance(person, recipes.Person), name
        assert person.name == "John", (name, person)
    for run in results["_runs"].values():  # the bound policy wrote every answer
        policies = {m.response_metadata["policy"]["policy"] for m in run["messages"] if m.type == "ai"}
        assert policies == {recipes.POLICIES[policy].name}


def test_forced_calls_are_the_calls_meant_and_never_silent(model: object) -> None:
    out = recipes.forced_calls(model)
    for choice in ("required", "any", "multiply"):
        message = out[choice]
        calls = [(c["name"], json.dumps(c["args"], sort_keys=True)) for c in message.tool_calls]
        assert calls and len(calls) == len(set(calls)), (choice, calls)  # no identical duplicates
        assert "<tool_call>" not in message.content and "</tool_call>" not in message.content
        # a repeated call ends the answer there (not at max_tokens), so a forced call ends "tool_calls"
        assert message.response_metadata["finish_reason"] == "tool_calls"
        assert message.usage_metadata["output_tokens"] < 100, message.usage_metadata
    cut = out["cut"]
    assert cut.tool_calls == [] and "max_tokens" in cut.invalid_tool_calls[0]["error"]
    structured = out["structured_cut"]
    assert structured["parsed"] is None and isinstance(structured["parsing_error"], OutputParserException)


@pytest.mark.parametrize("policy", list(recipes.ANY_WRITER))
def test_dspy_programs_parse_with_the_default_adapter(real_paths: object, policy: str) -> None:
    out = recipes.dspy_programs(recipes.ANY_WRITER[policy])
    assert isinstance(out["predict"].answer, int) and isinstance(out["react"].answer, int)
    assert isinstance(out["chain_of_thought"].answer, str) and out["chain_of_thought"].reasoning
    for entry in out["history"]:  # every answer in ChatAdapter's format: no fallback to JSON was needed
        assert entry["outputs"][0].startswith("[[ ## "), entry["outputs"][0][:80]
        assert entry["response"].finish_reason == "stop"


def test_the_server_ends_a_forced_answer_at_its_repeated_call(real_paths: object) -> None:
    import openai

    from ead_llm import EntropyAdaptiveLLM, LargeOnly
    from ead_llm.serving.server import create_app
    from tests.serving.conftest import serve

    draft, full = real_paths  # type: ignore[misc]
    llm = EntropyAdaptiveLLM(small=str(draft), large=str(full), policy=LargeOnly(), max_tokens=128)
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    spec = {"type": "function", "function": {"name": "multiply", "parameters": {**parameters, "required": ["a", "b"]}}}
    for url in serve(create_app(llm, "m")):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            asked = {"model": "m", "messages": [{"role": "user", "content": "What is 1 times 2?"}], "tools": [spec]}
            if not stream:
                reply = client.chat.completions.create(**asked, tool_choice="required")  # type: ignore[call-overload]
                calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
                assert reply.usage is not None and reply.usage.completion_tokens < 100
            else:
                chunks = list(client.chat.completions.create(**asked, tool_choice="required", stream=True))  # type: ignore[call-overload]
                calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
                finish = next(chunk.choices[0].finish_reason for chunk in chunks[::-1] if chunk.choices)
            assert calls and len({(c.function.name, c.function.arguments) for c in calls}) == len(calls)
            assert finish == "tool_calls"
