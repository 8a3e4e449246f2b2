"""Tool calling and structured output through LangChain, on tiny random pairs (weights do not matter: a
required or named tool and a JSON schema are enforced by the grammar, so every answer parses)."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from ead_llm import ChatEntropyAdaptive, EntropyAdaptiveLLM, LargeOnly, SpeculativeDecoding
from ead_llm.adapters.prompts import render, renders_tools
from ead_llm.adapters.tool_calls import (
    NO_CALL,
    CallReader,
    ToolPlan,
    parse_with_template,
    plan_tools,
    read_answer,
)
from ead_llm.core.grammar import ConstraintViolation, SequenceGrammar
from ead_llm.testing.tiny import build_tiny_pair, byte_bpe_tokenizer
from tests.tiny_pairs import BPE_CORPUS, CHAT_TEMPLATE

TOOL_CORPUS = [*BPE_CORPUS, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'] * 2
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[call {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}]"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A template that renders tools, calls and replies itself (as Qwen's and Llama 3.1's do)."""


RESPONSE_TEMPLATE = {
    "start_anchor": "<|assistant|>",
    "fields": {
        "content": {"close": "<tool_call>"},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}
"""A transformers response template for the Hermes format (``tokenizer.parse_response`` reads it)."""


@functools.cache
def pair(template: str = CHAT_TEMPLATE, response: str | None = None) -> tuple[str, str]:
    folder = Path(tempfile.mkdtemp(prefix="ead-llm-tools-"))
    tokenizer = byte_bpe_tokenizer(TOOL_CORPUS, vocab_size=400)
    tokenizer.chat_template = template
    if response is not None:
        tokenizer.response_template = json.loads(response)
    small, large = build_tiny_pair(folder, family="gpt2", tokenizer=tokenizer, seed=7, max_positions=2048)
    return str(small), str(large)


@pytest.fixture(scope="module")
def chat() -> ChatEntropyAdaptive:
    small, large = pair()
    return ChatEntropyAdaptive(small=small, large=large, max_tokens=120)


class Add(BaseModel):
    """Add two small integers."""

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Tokyo", "Lima"]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


class PersonDict(TypedDict):
    name: Literal["Ada", "Alan"]
    age: Literal[36, 41]


PERSON_SCHEMA = {
    "title": "person",
    "description": "A person.",
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "age"],
}


# -- tool choice --------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", "any"])
def test_a_required_tool_call_always_parses(chat: ChatEntropyAdaptive, choice: str) -> None:
    bound = chat.bind_tools([Add, Weather], tool_choice=choice)
    for i, prompt in enumerate(["What is 2 + 3?", "Weather in Lima?", "hello"]):
        message = bound.invoke(prompt, seed=i, temperature=1.0)
        assert message.tool_calls, message.content
        assert message.content == ""
        assert message.response_metadata["finish_reason"] == "tool_calls"
        for call in message.tool_calls:
            {"Add": Add, "Weather": Weather}[call["name"]].model_validate(call["args"])
            assert call["id"].startswith("call_")


def test_a_named_tool_is_called_exactly_once(chat: ChatEntropyAdaptive) -> None:
    for choice in ("Weather", {"type": "function", "function": {"name": "Weather"}}):
        message = chat.bind_tools([Add, Weather], tool_choice=choice).invoke("What is 2 + 3?")
        assert [c["name"] for c in message.tool_calls] == ["Weather"]
        Weather.model_validate(message.tool_calls[0]["args"])


def test_parallel_tool_calls_false_allows_one_call(chat: ChatEntropyAdaptive) -> None:
    for seed in range(3):
        bound = chat.bind_tools([Add, Weather], tool_choice="required", parallel_tool_calls=False)
        assert len(bound.invoke("go", seed=seed, temperature=1.0).tool_calls) == 1


def _accepts(grammar: SequenceGrammar, tokens: list[int]) -> bool:
    try:
        for token in tokens:
            grammar.accept(token, commit=True)
    except ConstraintViolation:
        return False
    return True


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_calls_out_of_the_answer(chat: ChatEntropyAdaptive) -> None:
    """As OpenAI and vLLM: the prompt lists the tools (each step of an agent loop starts with the same text, for
    the prefix cache) and the grammar refuses a call block, wherever the model would start one."""
    tools = [convert_to_openai_tool(Add)]
    none, auto = plan_tools(tools, "none"), plan_tools(tools, "auto")
    message = [HumanMessage("hi")]
    assert chat._prompt(message, none) == chat._prompt(message, auto) != chat._prompt(message, ToolPlan([], "none"))
    assert none.tools == [] and none.constraint is NO_CALL and none.reader() is None
    call = chat._call(message, None, {"tools": tools, "tool_choice": "none"})
    assert call.request.sampling.constraint is NO_CALL
    tokenizer = chat.shared_engine.tokenizer
    compiler = chat.shared_engine.grammars
    for text in ("plain text", "a <tool_call", "<tool_call>", 'x <tool_call>\n{"name": "Add"}', "<tool_call>\n"):
        allowed = _accepts(compiler.start(NO_CALL, 0), tokenizer.encode(text, add_special_tokens=False))
        assert allowed == ("<tool_call>" not in text), text
    answer = chat.bind_tools([Add], tool_choice="none").invoke("hi")
    assert answer.tool_calls == [] and "<tool_call>" not in str(answer.content)
    # the caller's own format stands in for the ban (it is no call either)
    assert chat.bind_tools([Add], tool_choice="none").invoke("hi", regex="[ab]{3}").content in {
        a + b + c for a in "ab" for b in "ab" for c in "ab"
    }


def test_a_named_tool_keeps_every_tool_in_the_prompt(chat: ChatEntropyAdaptive) -> None:
    tools = [convert_to_openai_tool(t) for t in (Add, Weather)]
    named, auto = plan_tools(tools, "Add"), plan_tools(tools, "auto")
    assert [t["function"]["name"] for t in named.tools] == ["Add"]
    assert chat._prompt([HumanMessage("hi")], named) == chat._prompt([HumanMessage("hi")], auto)


def test_bad_tool_choices_are_refused(chat: ChatEntropyAdaptive) -> None:
    with pytest.raises(ValueError, match="tool_choice"):
        chat.bind_tools([Add], tool_choice="Subtract")
    with pytest.raises(ValueError, match="needs tools"):
        chat.invoke("hi", tool_choice="required")
    assert len(chat.bind_tools([Add, Add.model_json_schema()]).kwargs["tools"]) == 1  # one tool, twice given
    with pytest.raises(ValueError, match="already constrain"):
        chat.bind_tools([Add], tool_choice="Add").invoke("hi", regex="a+")


def _calls(message: AIMessage) -> list[tuple[str, dict]]:
    """A message's calls without their ids (which are fresh per call)."""
    return [(c["name"], c["args"]) for c in message.tool_calls]


def test_greedy_speculative_tool_calls_equal_large_only(chat: ChatEntropyAdaptive) -> None:
    bound = chat.bind_tools([Add, Weather], tool_choice="required")
    for prompt in ("What is 2 + 3?", "Weather?"):
        large = bound.invoke(prompt, policy=LargeOnly())
        fast = bound.invoke(prompt, policy=SpeculativeDecoding(gamma=4))
        assert _calls(fast) == _calls(large)


def test_streamed_tool_call_chunks_add_up_to_the_calls(chat: ChatEntropyAdaptive) -> None:
    bound = chat.bind_tools([Add, Weather], tool_choice="required")
    chunks = list(bound.stream("What is 2 + 3?"))
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    assert _calls(total) == _calls(bound.invoke("What is 2 + 3?"))
    assert any(c.tool_call_chunks for c in chunks)
    assert total.response_metadata["finish_reason"] == "tool_calls" and total.usage_metadata["output_tokens"] > 0


# -- the conversation around calls ---------------------------------------------------------------------


def test_tool_messages_round_trip_through_the_fallback_format(chat: ChatEntropyAdaptive) -> None:
    call = chat.bind_tools([Add], tool_choice="Add").invoke("What is 2 + 3?")
    conversation = [
        SystemMessage("Be brief."),
        HumanMessage("What is 2 + 3?"),
        call,
        ToolMessage("5", tool_call_id=call.tool_calls[0]["id"]),
    ]
    tokenizer = chat.shared_engine.tokenizer
    assert not renders_tools(tokenizer)
    text = tokenizer.decode(
        chat._prompt(conversation, ToolPlan([{"type": "function", "function": {"name": "Add"}}], "auto"))
    )
    args = json.dumps({"name": "Add", "arguments": call.tool_calls[0]["args"]}, ensure_ascii=False)
    assert "Be brief." in text and "<tools>" in text  # the tools joined the system message
    assert f"<tool_call>\n{args}\n</tool_call>" in text and "<tool_response>\n5\n</tool_response>" in text
    follow = chat.bind_tools([Add]).invoke(conversation)
    assert isinstance(follow, AIMessage)


def test_a_template_that_renders_tools_gets_them_natively() -> None:
    small, large = pair(TOOLS_TEMPLATE)
    chat = ChatEntropyAdaptive(small=small, large=large, max_tokens=60)
    tokenizer = chat.shared_engine.tokenizer
    assert renders_tools(tokenizer)
    call = AIMessage("", tool_calls=[{"name": "Add", "args": {"a": 2, "b": 3}, "id": "call_1"}])
    conversation = [HumanMessage("2+3?"), call, ToolMessage("5", tool_call_id="call_1")]
    spec = [{"type": "function", "function": {"name": "Add", "parameters": Add.model_json_schema()}}]
    text = tokenizer.decode(chat._prompt(conversation, ToolPlan(spec, "auto")))
    assert text.startswith("<|tools|>Add;") and '[call Add {"a": 2, "b": 3}]' in text and "<|tool|>5" in text
    assert "<tool_call>" not in text  # the template's own format, not the fallback's
    message = chat.bind_tools([Add], tool_choice="Add").invoke("2+3?")
    assert [c["name"] for c in message.tool_calls] == ["Add"]


def test_a_tokenizer_with_a_response_template_parses_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = pair(CHAT_TEMPLATE, json.dumps(RESPONSE_TEMPLATE))
    chat = ChatEntropyAdaptive(small=small, large=large, max_tokens=60)
    tokenizer = chat.shared_engine.tokenizer
    assert tokenizer.response_template == RESPONSE_TEMPLATE  # saved with the tokenizer and loaded back
    text = 'Sure.\n<tool_call>\n{"name": "Add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_with_template(tokenizer, text, "<|user|>hi\n<|assistant|>", [])
    assert [(c.name, c.arguments) for c in calls] == [("Add", {"a": 1, "b": 2})]
    assert content == "Sure."
    parsed: list[str] = []
    original = tokenizer.parse_response
    monkeypatch.setattr(tokenizer, "parse_response", lambda *a, **k: parsed.append(a[0]) or original(*a, **k))
    message = chat.bind_tools([Add], tool_choice="Add").invoke("2+3?")
    assert len(parsed) == 1 and parsed[0].startswith("<tool_call>")  # the template read the answer
    assert [c["name"] for c in message.tool_calls] == ["Add"]
    Add.model_validate(message.tool_calls[0]["args"])


def test_an_agent_loop_runs_with_a_forced_tool() -> None:
    small, large = pair()
    chat = ChatEntropyAdaptive(small=small, large=large, max_tokens=80)
    calls: list[dict] = []

    @tool
    def weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append({"city": city})
        return "sunny"

    agent = create_agent(chat, [weather])
    first = agent.invoke({"messages": [HumanMessage("Weather in Lima?")]}, {"recursion_limit": 6})
    assert isinstance(first["messages"][-1], AIMessage)  # a random model may answer without a tool
    forced = create_agent(chat.bind_tools([weather], tool_choice="weather"), [weather])
    with pytest.raises(Exception, match=r"[Rr]ecursion"):  # forced every turn: it calls until the limit
        forced.invoke({"messages": [HumanMessage("Weather in Lima?")]}, {"recursion_limit": 5})
    assert calls and all(c["city"] in ("Paris", "Tokyo", "Lima") for c in calls)


def test_create_agent_returns_a_structured_response() -> None:
    small, large = pair()
    chat = ChatEntropyAdaptive(small=small, large=large, max_tokens=80)

    @tool
    def weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """The weather in a city."""
        return "sunny"

    class Report(BaseModel):
        city: Literal["Paris", "Tokyo", "Lima"]
        sunny: bool

    agent = create_agent(chat, [weather], response_format=Report)  # LangChain's tool strategy: a forced call
    out = agent.invoke({"messages": [HumanMessage("Weather in Lima?")]}, {"recursion_limit": 8})
    assert isinstance(out["structured_response"], Report)


# -- structured output ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.parametrize("schema", [Person, PersonDict, PERSON_SCHEMA], ids=["pydantic", "typeddict", "json"])
def test_structured_output_parses_into_the_schema(chat: ChatEntropyAdaptive, method: str, schema) -> None:
    structured = chat.with_structured_output(schema, method=method)
    for seed in range(2):
        out = structured.invoke("A person, please.", seed=seed, temperature=1.0)
        if schema is Person:
            assert isinstance(out, Person)
        else:
            assert isinstance(out, dict) and set(out) == {"name", "age"}


def test_structured_output_with_raw_and_json_mode(chat: ChatEntropyAdaptive) -> None:
    out = chat.with_structured_output(Person, include_raw=True).invoke("A person.")
    assert isinstance(out["raw"], AIMessage) and isinstance(out["parsed"], Person) and out["parsing_error"] is None
    raw = chat.with_structured_output(PERSON_SCHEMA, method="json_mode", include_raw=True).invoke("A person.")
    text = raw["raw"].content
    if raw["raw"].response_metadata["finish_reason"] == "stop":  # any JSON object: a random model may run long
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    with pytest.raises(ValueError, match="method"):
        chat.with_structured_output(Person, method="xml")


def test_the_text_llm_takes_per_call_constraints() -> None:
    small, large = pair()
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=80)
    assert json.loads(llm.invoke("x", json_schema=PersonDict))["name"] in ("Ada", "Alan")
    assert llm.invoke("x", regex=r"[0-9]{3}-[a-z]{2}")[3] == "-"
    assert llm.invoke("x", grammar='start: "yes" | "no"') in ("yes", "no")
    assert isinstance(llm.with_structured_output(Person).invoke("p"), Person)
    with pytest.raises(ValueError, match="at most one"):
        llm.invoke("x", regex="a", grammar='start: "a"')
    with pytest.raises(ValueError, match="regex"):
        llm.invoke("x", regex="a(")
    with pytest.raises(NotImplementedError, match="ChatEntropyAdaptive"):
        llm.bind_tools([Add])
    constrained = EntropyAdaptiveLLM(small=small, large=large, max_tokens=80, regex="(ab)+")
    assert set(constrained.invoke("x")) <= {"a", "b"}
    assert constrained.asdict()["regex"] == "(ab)+"


# -- the parsers ----------------------------------------------------------------------------------------


def test_the_reader_splits_text_calls_and_broken_blocks() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "Add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{oops}</tool_call>'
    content, calls, invalid = read_answer(None, text, "stop")
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("Add", {"a": 1})]
    assert [i.text for i in invalid] == ["<tool_call>{oops}</tool_call>"] and invalid[0].error.startswith("not JSON")
    assert read_answer(None, " no calls here\n", "stop") == (" no calls here\n", [], [])


def test_the_reader_drops_repeats_and_honours_parallel_false() -> None:
    block = '<tool_call>\n{"name": "Add", "arguments": {"a": 1}}\n</tool_call>'
    other = '<tool_call>\n{"name": "Add", "arguments": {"a": 2}}\n</tool_call>'
    reader = CallReader()
    content, calls, _ = reader.push("\n".join([block, block, other, block]), "stop")
    assert [c.arguments for c in calls] == [{"a": 1}, {"a": 2}] and reader.dropped == 2 and content.strip() == ""
    assert len({c.id for c in calls}) == 2
    single = CallReader(parallel=False)
    assert [c.arguments for c in single.push("\n".join([block, other]), "stop")[1]] == [{"a": 1}]


def test_a_block_cut_by_max_tokens_is_invalid_with_the_reason_not_text() -> None:
    content, calls, invalid = read_answer(None, 'Let me.\n<tool_call>\n{"name": "Add", "argu', "length")
    assert content == "Let me." and calls == []
    assert invalid[0].name == "Add" and "max_tokens" in invalid[0].error and invalid[0].text.startswith("<tool_call>")
    _, _, unclosed = CallReader().push('<tool_call>\n{"name": "Add"}', "stop")
    assert "never closed" in unclosed[0].error


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=8))
def test_the_stream_reader_gives_the_same_calls_wherever_the_text_is_cut(cuts: list[int]) -> None:
    text = 'a <b <tool_call>\n{"name": "Add", "arguments": {"a": 1}}\n</tool_call> c <tool_c'
    pieces, last = [], 0
    for cut in sorted({min(c, len(text)) for c in cuts}):
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    reader = CallReader()
    shown, calls = "", []
    for i, piece in enumerate(pieces):
        out, got, _ = reader.push(piece, "stop" if i == len(pieces) - 1 else None)
        shown += out
        calls += got
    assert shown == "a <b  c <tool_c"
    assert [(c.name, c.arguments) for c in calls] == [("Add", {"a": 1})]


def test_render_keeps_tuple_messages_working() -> None:
    small, _ = pair()
    tokenizer = ChatEntropyAdaptive(small=small, large=pair()[1]).shared_engine.tokenizer
    assert render(tokenizer, [("user", "hi")], "text") == "hi"
