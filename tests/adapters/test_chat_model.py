"""ChatEntropyAdaptive beyond the standard suites: prompts, usage, cost, refusals."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, FunctionMessage, HumanMessage, SystemMessage

from ead_llm import EAD, ChatEntropyAdaptive, EntropyAdaptiveLLM, LargeOnly
from ead_llm.adapters.prompts import fallback_chat_text
from tests.tiny_pairs import chat_pair


@pytest.fixture(scope="module")
def fallback_chat(gpt2_paths) -> ChatEntropyAdaptive:
    return ChatEntropyAdaptive(
        small=str(gpt2_paths[0]), large=str(gpt2_paths[1]), policy=EAD(threshold=3.0, min_dwell=2), max_tokens=10
    )


def test_fallback_template_prompt_is_what_the_llm_completes(fallback_chat, gpt2_paths) -> None:
    llm = EntropyAdaptiveLLM(
        small=str(gpt2_paths[0]), large=str(gpt2_paths[1]), policy=EAD(threshold=3.0, min_dwell=2), max_tokens=10
    )
    messages = [SystemMessage("Be brief."), HumanMessage("12+35="), AIMessage("47"), HumanMessage("1+1?")]
    reply = fallback_chat.invoke(messages)
    prompt = fallback_chat_text([("system", "Be brief."), ("user", "12+35="), ("assistant", "47"), ("user", "1+1?")])
    assert reply.content == llm.invoke(prompt)
    assert reply.usage_metadata["input_tokens"] == len(llm.shared_engine.encode(prompt))  # type: ignore[index]


def test_chat_template_pair_and_usage() -> None:
    small, large = chat_pair()
    chat = ChatEntropyAdaptive(small=small, large=large, max_tokens=8, ignore_eos=True)
    reply = chat.invoke([HumanMessage("hello")])
    tokenizer = chat.shared_engine.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    usage = dict(reply.usage_metadata or {})
    details = usage.pop("input_token_details", {})  # an earlier test in this process may have sent "hello" too
    assert usage == {
        "input_tokens": len(ids["input_ids"]),
        "output_tokens": 8,
        "total_tokens": len(ids["input_ids"]) + 8,
    }
    cost = reply.response_metadata["cost"]
    assert details.get("cache_read", 0) == cost["large_cached_tokens"] < len(ids["input_ids"])
    assert cost["completion_tokens"] == 8 and len(reply.response_metadata["models"]) == 8
    chunks = list(chat.stream([HumanMessage("hello")]))
    assert [c.usage_metadata is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.content for c in chunks) == reply.content  # type: ignore[misc]


def test_embedded_pair_passes_a_message_through_unchanged() -> None:
    chat = ChatEntropyAdaptive(policy=LargeOnly())
    llm = EntropyAdaptiveLLM(policy=LargeOnly())
    reply = chat.invoke("4821+3907-1568\n")
    assert reply.content == llm.invoke("4821+3907-1568\n")
    assert reply.content.endswith("#### 7160\n")  # type: ignore[union-attr]


def test_policy_override_and_refusals(fallback_chat) -> None:
    reply = fallback_chat.invoke("12+35=", policy=LargeOnly())
    assert set(reply.response_metadata["models"]) == {"L"}
    with pytest.raises(ValueError, match="system, human, AI and tool messages"):
        fallback_chat.invoke([HumanMessage("x"), FunctionMessage("3", name="f")])
    with pytest.raises(ValueError, match="text only"):
        fallback_chat.invoke([HumanMessage([{"type": "image", "url": "https://x/y.png"}])])
    with pytest.raises(ValueError, match="policy must be a policy object"):
        fallback_chat.invoke("x", policy="large")


def test_langchain_cache_and_stop(gpt2_paths, monkeypatch: pytest.MonkeyPatch) -> None:
    from langchain_core.caches import InMemoryCache

    chat = ChatEntropyAdaptive(small=str(gpt2_paths[0]), large=str(gpt2_paths[1]), max_tokens=12, cache=InMemoryCache())
    calls = []
    original = chat.shared_engine.generate
    monkeypatch.setattr(chat.shared_engine, "generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    first = chat.invoke("hello there")
    assert chat.invoke("hello there").content == first.content and len(calls) == 1
    chat.invoke("hello there", policy=LargeOnly())
    assert len(calls) == 2
    free = chat.invoke("stop here").content
    stop = free[3:5]  # type: ignore[index]
    cut = chat.invoke("stop here", stop=[stop])
    assert cut.content == free[: free.index(stop)] and cut.response_metadata["finish_reason"] == "stop"  # type: ignore[union-attr]
