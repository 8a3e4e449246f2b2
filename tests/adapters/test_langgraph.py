"""The pair inside LangGraph: token streaming in ``stream_mode="messages"``, and agents on the chat model."""

from __future__ import annotations

from typing import TypedDict

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph

from ead_llm import ChatEntropyAdaptive, EntropyAdaptiveLLM
from ead_llm.evaluation.task import problems

PROMPT = problems("test", 1)[0].prompt


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def test_a_chat_node_streams_its_tokens_in_messages_mode() -> None:
    chat = ChatEntropyAdaptive(max_tokens=200)

    def solve(state: MessagesState) -> dict[str, list[AIMessage]]:
        return {"messages": [chat.invoke(state["messages"])]}

    graph = StateGraph(MessagesState).add_node("solve", solve).add_edge(START, "solve").add_edge("solve", END).compile()
    pieces = [
        chunk
        for chunk, meta in graph.stream({"messages": [HumanMessage(PROMPT)]}, stream_mode="messages")
        if isinstance(chunk, AIMessageChunk) and meta["langgraph_node"] == "solve"
    ]
    text = chat.invoke([HumanMessage(PROMPT)]).content
    assert len(pieces) > 10 and "".join(str(p.content) for p in pieces) == text  # token by token
    assert pieces[-1].usage_metadata is not None and pieces[-1].response_metadata["cost"]["completion_tokens"] > 0


def test_a_text_llm_node_runs_in_a_graph() -> None:
    llm = EntropyAdaptiveLLM(max_tokens=200)

    class State(TypedDict):
        problem: str
        work: str

    graph = (
        StateGraph(State)
        .add_node("solve", lambda state: {"work": llm.invoke(state["problem"])})
        .add_edge(START, "solve")
        .add_edge("solve", END)
        .compile()
    )
    updates = list(graph.stream({"problem": PROMPT, "work": ""}, stream_mode="updates"))
    assert updates == [{"solve": {"work": llm.invoke(PROMPT)}}]


def test_the_text_llm_sends_agents_to_the_chat_model() -> None:
    agent = create_agent(EntropyAdaptiveLLM(max_tokens=10), [add])  # create_agent binds the tools on its first turn
    with pytest.raises(NotImplementedError, match=r"completion model.*ChatEntropyAdaptive"):
        agent.invoke({"messages": [("human", "1+2")]})


def test_a_react_agent_builds_on_the_chat_model() -> None:
    agent = create_agent(ChatEntropyAdaptive(max_tokens=10), [add])
    assert "tools" in agent.get_graph().nodes
