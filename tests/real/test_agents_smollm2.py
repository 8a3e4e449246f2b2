"""The agent recipes of ``integrations/agents_smollm2.py`` on SmolLM2: each finishes (a loop would hit the
recursion limit and raise), with the object, the calls it means, or fields DSPy's default adapter parses."""

from __future__ import annotations

import json

import pytest
from langchain_core.exceptions import OutputParserException

from integrations import agents_smollm2 as recipes

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # about 3 minutes on 2 cores


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


@pytest.mark.parametrize("policy", list(recipes.POLICIES))
def test_dspy_programs_parse_with_the_default_adapter(real_paths: object, policy: str) -> None:
    out = recipes.dspy_programs(recipes.POLICIES[policy])
    assert isinstance(out["predict"].answer, int) and isinstance(out["react"].answer, int)
    assert isinstance(out["chain_of_thought"].answer, str) and out["chain_of_thought"].reasoning
    for entry in out["history"]:  # every answer in ChatAdapter's format: no fallback to JSON was needed
        assert entry["outputs"][0].startswith("[[ ## "), entry["outputs"][0][:80]
        assert entry["response"].finish_reason == "stop"
