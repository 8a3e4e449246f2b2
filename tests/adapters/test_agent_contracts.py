"""What an agent framework relies on, tried to break on a tiny random pair: forced calls that are never doubled or
silent, bound settings that survive LangChain's and LangGraph's wrapping, bounded structured answers, one bill
however it is read, unique call ids and short model names. (The same recipes on SmolLM2 are in
``integrations/agents_smollm2.py``, run by CI's slow set.)"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal

import dspy
import httpx
import pytest
from dspy.adapters import ChatAdapter
from langchain_core.caches import InMemoryCache
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage
from pydantic import BaseModel, Field

from ead_llm import ChatEntropyAdaptive, EntropyAdaptiveLLM, LargeOnly, Pricing, SmallOnly, track_cost
from ead_llm.adapters.dspy_formats import chat_adapter_constraint
from ead_llm.adapters.tool_calls import CallReader
from ead_llm.core.grammar import Constraint, JsonBounds
from ead_llm.serving.server import create_app
from tests.adapters.test_tools import pair
from tests.serving.conftest import serve


class Add(BaseModel):
    """Add two integers."""

    a: int
    b: int


class Note(BaseModel):
    """A note."""

    title: str = Field(description="a short title")
    stars: int


@pytest.fixture(scope="module")
def chat() -> ChatEntropyAdaptive:
    small, large = pair()
    return ChatEntropyAdaptive(small=small, large=large, max_tokens=120)


# -- forced calls ---------------------------------------------------------------------------------------


def test_a_repeated_call_counts_once_and_leaves_no_markup(chat: ChatEntropyAdaptive) -> None:
    block = '<tool_call>\n{"name": "Add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    forced = chat.bind_tools([Add], tool_choice="required")
    for seed in range(6):
        message = forced.invoke("What is 1 + 2?", seed=seed, temperature=1.0)
        pairs = [(c["name"], json.dumps(c["args"], sort_keys=True)) for c in message.tool_calls]
        assert message.tool_calls and len(pairs) == len(set(pairs))  # never the same call twice
        assert "<tool_call>" not in message.content and "</tool_call>" not in message.content
    content, calls, _ = CallReader().push(f"{block}\n{block}\n{block}", "stop")
    assert len(calls) == 1 and "<tool_call>" not in content


def test_a_completion_ends_where_its_caller_says(chat: ChatEntropyAdaptive) -> None:
    plan = chat._tools({})
    (request,) = chat._requests([chat._prompt([HumanMessage("hi")], plan)], None, {"max_tokens": 40})
    seen: list[str] = []
    events = list(chat._stream_events(request, lambda e: seen.append(e.text) or len(seen) == 3))
    assert len(events) == 3 and events[-1][0].finish_reason is not None and events[-1][1] is not None
    assert events[-1][1].completion_tokens == 3  # the bill covers what was delivered


def test_parallel_tool_calls_false_means_at_most_one_call_under_auto_too(chat: ChatEntropyAdaptive) -> None:
    block = '<tool_call>\n{{"name": "Add", "arguments": {{"a": {a}, "b": 2}}}}\n</tool_call>'
    text = "\n".join(block.format(a=a) for a in range(3))
    assert len(CallReader(parallel=False).push(text, "stop")[1]) == 1
    assert len(CallReader(parallel=True).push(text, "stop")[1]) == 3
    for seed in range(3):
        message = chat.bind_tools([Add], parallel_tool_calls=False).invoke("1 + 2?", seed=seed, temperature=1.0)
        assert len(message.tool_calls) <= 1


def test_a_forced_call_cut_by_max_tokens_is_an_invalid_call_with_the_reason(chat: ChatEntropyAdaptive) -> None:
    forced = chat.bind_tools([Add], tool_choice="Add")
    message = forced.invoke("What is 1 + 2?", max_tokens=6)
    assert message.tool_calls == [] and message.response_metadata["finish_reason"] == "length"
    (invalid,) = message.invalid_tool_calls
    assert "max_tokens" in invalid["error"] and invalid["args"].startswith("<tool_call>")
    assert "<tool_call>" not in message.content
    streamed = None
    for chunk in forced.stream("What is 1 + 2?", max_tokens=6):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.invalid_tool_calls and not streamed.tool_calls
    assert "<tool_call>" not in streamed.content


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_structured_output_cut_by_max_tokens_is_never_silent(chat: ChatEntropyAdaptive, method: str) -> None:
    structured = chat.with_structured_output(Add, method=method)  # type: ignore[arg-type]
    with pytest.raises(OutputParserException, match="max_tokens"):
        structured.invoke("1 + 2?", max_tokens=4)  # type: ignore[call-arg]
    raw = chat.bind(max_tokens=4).with_structured_output(Add, method=method, include_raw=True)  # type: ignore[arg-type]
    out = raw.invoke("1 + 2?")
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
    assert "max_tokens" in str(out["parsing_error"]) and isinstance(out["raw"], AIMessage)


def test_ids_are_fresh_per_call(chat: ChatEntropyAdaptive) -> None:
    forced = chat.bind_tools([Add], tool_choice="Add")
    first, second = forced.invoke("What is 1 + 2?"), forced.invoke("What is 1 + 2?")
    assert first.tool_calls[0]["args"] == second.tool_calls[0]["args"]  # the same answer (greedy)...
    assert first.tool_calls[0]["id"] != second.tool_calls[0]["id"]  # ...with its own id


# -- bound settings ---------------------------------------------------------------------------------------


def _policy(message: AIMessage) -> str:
    return message.response_metadata["policy"]["policy"]


def test_bound_settings_survive_bind_tools_structured_output_and_unwrapping(chat: ChatEntropyAdaptive) -> None:
    bound = chat.bind(policy=LargeOnly(), max_tokens=50)
    assert _policy(bound.invoke("hi")) == "large_only"
    tools = bound.bind_tools([Add], tool_choice="Add")
    assert _policy(tools.invoke("1 + 2?")) == "large_only"
    assert tools.bind(temperature=0.0).bound.policy == LargeOnly()  # type: ignore[attr-defined]
    assert bound.bound.policy == LargeOnly() and bound.bound.max_tokens == 50  # type: ignore[attr-defined]
    raw = bound.with_structured_output(Add, method="function_calling", include_raw=True).invoke("1 + 2?")
    assert _policy(raw["raw"]) == "large_only"
    assert _policy(chat.invoke("hi")) == "speculative"  # the model itself is unchanged (uncalibrated pair)
    assert bound.bind(policy=SmallOnly()).bound.policy == SmallOnly()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="policy"):
        chat.bind(policy="fast").invoke("hi")  # refused at the call, where callbacks see it


# -- bounds ------------------------------------------------------------------------------------------------


def _accepts(constraint: Constraint, text: str) -> bool:
    import llguidance
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair()[1])
    matcher = llguidance.LLMatcher(from_tokenizer(tokenizer), constraint.grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_schema_grammars_bound_numbers_strings_and_lists_unless_lifted() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"}},
        "required": ["n", "x", "s"],
    }
    bounded, free = Constraint.json_schema(schema), Constraint.json_schema(schema, bounds=None)
    ok = '{"n":-12,"x":1.5,"s":"hi"}'
    long_int, long_frac = '{"n":' + "1" * 16 + ',"x":1,"s":""}', '{"n":1,"x":1.1234567,"s":""}'
    long_string = '{"n":1,"x":1,"s":"' + "a" * 257 + '"}'
    assert _accepts(bounded, ok) and _accepts(free, ok)
    for text in (long_int, long_frac, long_string):
        assert not _accepts(bounded, text) and _accepts(free, text)
    own = Constraint.json_schema({"type": "string", "maxLength": 400})  # a schema's own bound wins
    assert _accepts(own, '"' + "a" * 300 + '"')
    tight = Constraint.json_schema({"type": "array", "items": {"type": "integer"}}, bounds=JsonBounds(max_items=2))
    assert _accepts(tight, "[1,2]") and not _accepts(tight, "[1,2,3]")
    with pytest.raises(ValueError, match="max_items"):
        JsonBounds(max_items=0)


def test_maps_and_open_values_are_bounded_too() -> None:
    open_map = Constraint.json_schema({"type": "object", "additionalProperties": True})  # dict[str, Any]
    anything = Constraint.json_schema({})
    nested = '{"a":[1,{"b":"x"}],"c":null,"d":1.5}'
    assert _accepts(open_map, nested) and _accepts(anything, nested) and _accepts(anything, '[true,"s"]')
    assert not _accepts(open_map, '{"' + "k" * 65 + '":1}')  # a key: 64 characters at most
    assert not _accepts(open_map, '{"a":"' + "v" * 257 + '"}')  # an open value: within the same bounds
    many = "{" + ",".join(f'"k{i}":{i}' for i in range(33)) + "}"
    assert not _accepts(open_map, many) and _accepts(Constraint.json_schema({"type": "object"}, bounds=None), many)
    ints = Constraint.json_schema({"type": "object", "additionalProperties": {"type": "integer"}})
    assert _accepts(ints, '{"a":1}') and not _accepts(ints, '{"a":"x"}')


def test_a_weak_model_ends_a_structured_answer_under_the_bounds() -> None:
    small, large = pair()
    tight = ChatEntropyAdaptive(small=small, large=large, max_tokens=200, json_bounds=JsonBounds(max_string_length=8))
    for seed in range(3):
        note = tight.with_structured_output(Note).invoke("A note.", seed=seed, temperature=1.0)  # type: ignore[call-arg]
        assert isinstance(note, Note) and len(note.title) <= 8


# -- the bill ----------------------------------------------------------------------------------------------


def test_cost_usd_is_none_without_prices(chat: ChatEntropyAdaptive) -> None:
    with track_cost() as tracker:
        chat.invoke("hi", max_tokens=3)
    assert tracker.cost_usd is None and "cost_usd" not in tracker.cost
    priced = chat.model_copy(update={"pricing": Pricing(small_output=1.0, large_output=10.0, large_input=1.0)})
    with track_cost() as tracker:
        priced.invoke("hi", max_tokens=3)
    assert tracker.cost_usd is not None and tracker.cost_usd > 0


def test_a_langchain_cache_hit_is_billed_once_however_it_is_read() -> None:
    small, large = pair()
    cached = ChatEntropyAdaptive(small=small, large=large, max_tokens=12, cache=InMemoryCache())
    with track_cost() as tracker:
        first, second = cached.invoke("hi"), cached.invoke("hi")
    assert second.content == first.content and second.response_metadata.get("cache_hit") is True
    assert tracker.calls == 1 and tracker.completion_tokens == first.response_metadata["cost"]["completion_tokens"]
    bills = [m.response_metadata["cost"] for m in (first, second)]
    assert sum(b["completion_tokens"] for b in bills) == tracker.completion_tokens
    assert sum(b["flops"] for b in bills) == tracker.flops
    usage = [m.usage_metadata for m in (first, second)]
    assert sum(u["output_tokens"] for u in usage if u) == tracker.completion_tokens


def test_a_langchain_cache_hit_of_the_text_llm_is_billed_once() -> None:
    small, large = pair()
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=6, cache=InMemoryCache())
    with track_cost() as tracker:
        first = llm.generate(["hi", "yo"])
        second = llm.generate(["hi", "new"])  # one hit, one fresh prompt
    bills = [g[0].generation_info["cost"] for result in (first, second) for g in result.generations]
    assert [b.get("cache_hit", False) for b in bills] == [False, False, True, False]
    assert sum(b["completion_tokens"] for b in bills) == tracker.completion_tokens and tracker.calls == 2
    assert second.generations[0][0].text == first.generations[0][0].text
    assert llm.generate(["hi"]).generations[0][0].generation_info["cost"]["cache_hit"]  # the stored copy unchanged


def test_a_dspy_cache_hit_is_billed_once_however_it_is_read(tmp_path: Path) -> None:
    small, large = pair()
    dspy.configure_cache(enable_disk_cache=True, enable_memory_cache=False, disk_cache_dir=str(tmp_path))
    try:
        lm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=6)
        with track_cost() as tracker, dspy.track_usage() as usage:
            first, second = lm("hello"), lm("hello")
        assert first == second and tracker.calls == 1
        bills = [entry["ead_cost"] for entry in lm.history]
        assert bills[1]["cache_hit"] and bills[1]["completion_tokens"] == 0
        assert sum(b["completion_tokens"] for b in bills) == tracker.completion_tokens
        assert usage.get_total_tokens()[lm.model]["completion_tokens"] == tracker.completion_tokens
        with track_cost() as other:  # another policy is another cache entry: never the first policy's answer
            lm.copy(policy=LargeOnly())("hello")
        assert other.calls == 1
    finally:
        dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True, disk_cache_dir=tempfile.mkdtemp())


def test_a_streamed_message_carries_what_an_invoked_one_does(chat: ChatEntropyAdaptive) -> None:
    invoked = chat.invoke("hi", max_tokens=8)
    streamed = None
    for chunk in chat.stream("hi", max_tokens=8):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.content == invoked.content
    for key in ("policy", "token_usage", "model_name", "finish_reason", "model_provider"):
        assert streamed.response_metadata[key] == invoked.response_metadata[key], key
    assert streamed.usage_metadata == invoked.usage_metadata


def test_model_names_are_short_and_never_a_path(chat: ChatEntropyAdaptive) -> None:
    large = Path(pair()[1])
    assert chat.model_name == f"ead-llm/{large.name}"
    message = chat.invoke("hi", max_tokens=2)
    assert message.response_metadata["model_name"] == chat.model_name and str(large) not in str(
        message.response_metadata
    )
    lm = EntropyAdaptiveLLM(small=pair()[0], large=str(large), max_tokens=2, cache=False)
    assert lm.model == chat.model_name and "/" not in lm.model.removeprefix("ead-llm/")
    assert lm._get_ls_params()["ls_model_name"] == chat.model_name
    assert EntropyAdaptiveLLM().model == "ead-llm/embedded"


# -- the server ----------------------------------------------------------------------------------------------


def test_the_server_never_answers_a_forced_call_without_a_call_or_an_error() -> None:
    small, large = pair()
    tool = {"type": "function", "function": {"name": "Add", "parameters": Add.model_json_schema()}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "1 + 2?"}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 5,
    }
    for url in serve(create_app(EntropyAdaptiveLLM(small=small, large=large), "m")):
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
        assert "max_tokens" in reply.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        assert chunks[-1]["error"]["param"] == "max_tokens"  # the stream ends in an error, not a silent stop
        assert any(c.get("choices") and c["choices"][0]["finish_reason"] == "length" for c in chunks)
        ok = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 120}, timeout=60).json()
        assert ok["choices"][0]["finish_reason"] == "tool_calls" and ok["choices"][0]["message"]["tool_calls"]


# -- DSPy's ChatAdapter -----------------------------------------------------------------------------------------


class Report(dspy.Signature):
    """Answer."""

    question: str = dspy.InputField()
    reasoning: str = dspy.OutputField()
    answer: int = dspy.OutputField()
    kind: Literal["a", "b c"] = dspy.OutputField()
    flag: bool = dspy.OutputField()
    data: list[int] = dspy.OutputField()


def test_the_chat_adapter_format_becomes_a_grammar() -> None:
    messages = ChatAdapter().format(Report, demos=[], inputs={"question": "q?"})
    constraint = chat_adapter_constraint([(m["role"], m["content"]) for m in messages])
    assert constraint is not None
    good = (
        "[[ ## reasoning ## ]]\nThink [a].\n\nMore.\n\n[[ ## answer ## ]]\n42\n\n[[ ## kind ## ]]\nb c\n\n"
        "[[ ## flag ## ]]\nTrue\n\n[[ ## data ## ]]\n[1,2]\n\n[[ ## completed ## ]]"
    )
    assert _accepts(constraint, good)
    assert ChatAdapter().parse(Report, good)["answer"] == 42
    for bad in (good.replace("42", "forty"), good.replace("b c", "d"), good.replace("True", "yes")):
        assert not _accepts(constraint, bad)
    assert not _accepts(constraint, good.replace("[[ ## kind ## ]]\nb c\n\n", ""))  # every field, in order
    assert chat_adapter_constraint([("user", "plain question")]) is None  # not the adapter's format: free


def test_dspy_programs_parse_with_the_default_adapter_on_a_random_pair() -> None:
    small, large = pair()
    bounds = JsonBounds(max_items=4)  # a random model's list: short, so the answer fits max_tokens
    lm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=300, cache=False, json_bounds=bounds)
    with dspy.context(lm=lm, adapter=None):
        for seed in range(3):
            out = dspy.Predict(Report)(question="q?", config={"seed": seed, "temperature": 1.0})
            assert isinstance(out.answer, int) and out.kind in ("a", "b c") and isinstance(out.data, list)
    assert all(entry["outputs"][0].startswith("[[ ## reasoning ## ]]") for entry in lm.history)  # no fallback
    free = lm.copy(enforce_adapter_format=False)
    assert free.dspy_metadata() != lm.dspy_metadata()  # another cache entry
