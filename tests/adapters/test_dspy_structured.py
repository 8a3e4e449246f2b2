"""DSPy's JSONAdapter on the pair: the response_format it sends becomes a grammar constraint, so typed
outputs always parse (a tiny random pair: the weights do not matter); StrictJSONAdapter sends a full
schema where JSONAdapter would fall back to any JSON object."""

from __future__ import annotations

import json
from typing import Any, Literal

import dspy
import pytest
from dspy.lm15 import UnsupportedFeatureError

from ead_llm import EntropyAdaptiveLLM, StrictJSONAdapter
from ead_llm.adapters.dspy_engine import response_constraint
from tests.adapters.test_tools import pair


class Verdict(dspy.Signature):
    """Judge the claim."""

    claim: str = dspy.InputField()
    verdict: Literal["true", "false", "unsure"] = dspy.OutputField()
    sure: bool = dspy.OutputField()


class Routed(dspy.Signature):
    """Pick a tool and its arguments."""

    question: str = dspy.InputField()
    tool: Literal["add", "capital", "finish"] = dspy.OutputField()
    args: dict[str, Any] = dspy.OutputField()


@pytest.fixture(scope="module")
def lm() -> EntropyAdaptiveLLM:
    small, large = pair()
    return EntropyAdaptiveLLM(small=small, large=large, max_tokens=150, cache=False)


def test_json_adapter_outputs_always_parse(lm: EntropyAdaptiveLLM) -> None:
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        for i, claim in enumerate(["The sky is green.", "2 + 2 = 4", "Paris is in Peru."]):
            out = dspy.Predict(Verdict)(claim=claim, config={"temperature": 1.0, "seed": i})
            assert out.verdict in ("true", "false", "unsure") and isinstance(out.sure, bool)
            assert json.loads(lm.history[-1]["outputs"][0]) == {"verdict": out.verdict, "sure": out.sure}


def test_strict_json_adapter_enforces_a_literal_beside_a_free_dict(lm: EntropyAdaptiveLLM) -> None:
    sent: list[Any] = []
    adapter = StrictJSONAdapter()
    with dspy.context(lm=lm, adapter=adapter):
        kwargs: dict[str, Any] = {}
        adapter._prepare_response_format(lm, kwargs, Routed)
        sent.append(kwargs["response_format"])
        raw = lm("2+3?", response_format=kwargs["response_format"])[0]
    schema = sent[0]["json_schema"]["schema"]
    assert schema["properties"]["tool"]["enum"] == ["add", "capital", "finish"]
    text = raw if isinstance(raw, str) else raw["text"]
    assert text.startswith('{"tool":"')
    assert text[len('{"tool":"') :].split('"')[0] in ("add", "capital", "finish")  # the Literal held


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, "json_object"),
        ({"type": "json_schema", "schema": {"type": "object"}, "name": "a"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "json_schema"),
    ],
)
def test_response_formats_become_constraints(value: Any, kind: str | None) -> None:
    constraint = response_constraint(value)
    assert (constraint.kind if constraint else None) == kind


def test_unknown_response_formats_are_refused() -> None:
    with pytest.raises(UnsupportedFeatureError, match="yaml"):
        response_constraint({"type": "yaml"})
    with pytest.raises(UnsupportedFeatureError, match="schema"):
        response_constraint({"type": "json_schema"})
