"""Cancellation frees the engine: every async path awaits the engine itself, so cancelling the awaiting task
(``task.cancel()``, ``asyncio.wait_for``, a consumer that stops) retires the requests at the end of the step
running when it happened. Checked by counting engine steps, never by timing."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import dspy
import pytest

from ead_llm import ChatEntropyAdaptive, EntropyAdaptiveLLM, LargeOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from tests.tiny_pairs import chat_pair

LONG = 400
"""Tokens each request would decode if nothing stopped it (the tiny pair's context is 512)."""
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 42), range(50, 82), strict=True)]  # 32 prompts


def wait_idle(engine: Engine, deadline_s: float = 60.0) -> None:
    """Until nothing runs or waits (the deadline only guards against a hang)."""
    end = time.monotonic() + deadline_s
    while engine.load["running"] or engine.load["waiting"]:
        assert time.monotonic() < end, f"the engine is still busy: {engine.load}"
        threading.Event().wait(0.005)


async def cancel_once_decoding(engine: Engine, make: Callable[[], Awaitable[Any]]) -> int:
    """Start ``make()`` as a task, cancel it once the engine is decoding it, and return the engine's step count
    right after the cancellation has been delivered."""
    task = asyncio.ensure_future(make())
    end = time.monotonic() + 60
    while not engine.load["running"]:
        assert not task.done(), "the call ended before it could be cancelled"
        assert time.monotonic() < end
        await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return engine.steps


def assert_freed_within_one_step(engine: Engine, steps_at_cancel: int, steps: int = 1) -> None:
    wait_idle(engine)
    ran = engine.steps - steps_at_cancel
    assert ran <= steps, f"{ran} steps ran after the cancel"
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


@pytest.fixture
def llm(llama_paths) -> EntropyAdaptiveLLM:
    small, large = llama_paths
    return EntropyAdaptiveLLM(small=str(small), large=str(large), max_tokens=LONG, ignore_eos=True, max_batch=64)


@pytest.mark.parametrize("policy", [LargeOnly(), SpeculativeDecoding(gamma=3)], ids=["large_only", "speculative"])
def test_cancelling_agenerate_frees_the_engine(llama_pair, policy: Any) -> None:
    engine = Engine(llama_pair)
    requests = [Request(p, policy, SamplingParams(max_tokens=LONG, ignore_eos=True)) for p in PROMPTS]
    at = asyncio.run(cancel_once_decoding(engine, lambda: engine.agenerate(requests)))
    assert_freed_within_one_step(engine, at)
    assert engine.generate(requests[:2])[0].token_ids  # and it serves on


def test_wait_for_a_timeout_frees_the_engine(llama_pair) -> None:
    engine = Engine(llama_pair)
    requests = [Request(p, LargeOnly(), SamplingParams(max_tokens=LONG, ignore_eos=True)) for p in PROMPTS]

    async def main() -> int:
        waiter = asyncio.ensure_future(asyncio.wait_for(engine.agenerate(requests), timeout=3600))
        while not engine.load["running"]:
            await asyncio.sleep(0.002)
        waiter.cancel()  # what wait_for does on its own timer: cancel the inner await
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return engine.steps

    assert_freed_within_one_step(engine, asyncio.run(main()))

    async def expired() -> int:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.agenerate(requests), timeout=0.05)
        return engine.steps

    assert_freed_within_one_step(engine, asyncio.run(expired()))


def test_cancelling_ainvoke_and_abatch_frees_the_engine(llm: EntropyAdaptiveLLM) -> None:
    engine = llm.shared_engine
    for make in (
        lambda: llm.ainvoke(PROMPTS[0]),
        lambda: llm.abatch(PROMPTS),
        lambda: llm.abatch(PROMPTS, return_exceptions=True),
        lambda: llm.agenerate(PROMPTS[:8], policy=SpeculativeDecoding(gamma=2)),
    ):
        at = asyncio.run(cancel_once_decoding(engine, make))
        assert_freed_within_one_step(engine, at)


def test_a_call_cancelled_while_still_submitting_is_never_queued(
    llm: EntropyAdaptiveLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``abatch(return_exceptions=True)`` submits one call per input; cancelled once the first decodes, the
    calls still being encoded in worker threads must not be queued afterwards (the race CI once lost: they
    were queued after the cancel, and ran steps the caller no longer wanted)."""
    engine = llm.shared_engine
    submit, opened, release = engine._submit, [], threading.Event()
    first = threading.Semaphore(1)

    def held_back(requests: Any, timeout_s: Any, **options: Any) -> Any:
        if not first.acquire(blocking=False):  # every submission but the first waits until the caller has left
            release.wait(60)
        return submit(requests, timeout_s, **options)

    def counted_open(stream: Any, call: Any, sequences: Any) -> Any:
        opened.append(call)
        return Engine._open(engine, stream, call, sequences)

    monkeypatch.setattr(engine, "_submit", held_back)
    monkeypatch.setattr(engine, "_open", counted_open)

    async def main() -> int:
        steps = await cancel_once_decoding(engine, lambda: llm.abatch(PROMPTS[:6], return_exceptions=True))
        release.set()
        return steps

    at = asyncio.run(main())  # asyncio.run waits for the worker threads it released
    assert len(opened) == 1, f"{len(opened) - 1} calls were queued after their caller had left"
    assert_freed_within_one_step(engine, at)


def test_an_abandoned_submission_is_cancelled_or_never_queued(llama_pair) -> None:
    """Both orders of the hand-over between the worker that queues and the caller that leaves."""
    from ead_llm.core.frontend import _Submission

    engine = Engine(llama_pair)
    requests = [Request(p, LargeOnly(), SamplingParams(max_tokens=LONG, ignore_eos=True)) for p in PROMPTS[:2]]
    loop = asyncio.new_event_loop()
    try:
        late = _Submission()
        late.abandon()  # the caller left before the worker finished encoding
        stream = engine._submit_unless_abandoned(late, requests, None, loop, isolate=False)
        assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0} and engine.steps == 0
        assert not stream._call.open

        early = _Submission()
        stream = engine._submit_unless_abandoned(early, requests, None, loop, isolate=False)
        assert not stream._call.cancelled
        early.abandon()  # the worker queued first: leaving cancels at once, not when the loop next runs
        assert stream._call.cancelled
        wait_idle(engine)
        assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    finally:
        loop.close()


def test_cancelling_a_chat_call_and_a_stream_frees_the_engine(llama_paths) -> None:
    small, large = llama_paths
    chat = ChatEntropyAdaptive(small=str(small), large=str(large), max_tokens=LONG, ignore_eos=True)
    engine = chat.shared_engine
    at = asyncio.run(cancel_once_decoding(engine, lambda: chat.ainvoke("12+35=")))
    assert_freed_within_one_step(engine, at)

    async def consume() -> None:
        async for _ in chat.astream("12+35="):
            pass

    at = asyncio.run(cancel_once_decoding(engine, consume))
    assert_freed_within_one_step(engine, at)


def test_cancelling_a_dspy_call_frees_the_engine(llm: EntropyAdaptiveLLM) -> None:
    engine = llm.shared_engine
    at = asyncio.run(cancel_once_decoding(engine, lambda: llm.acall("12+35=", cache=False)))
    assert_freed_within_one_step(engine, at)
    small, large = chat_pair()  # a context long enough for ChatAdapter's prompt
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=LONG, ignore_eos=True, cache=False)
    engine = llm.shared_engine

    async def streamed() -> None:
        stream = dspy.streamify(dspy.Predict("question -> answer"), async_streaming=True)
        with dspy.context(lm=llm, adapter=dspy.ChatAdapter()):
            async for _ in stream(question="12+35="):
                pass

    at = asyncio.run(cancel_once_decoding(engine, streamed))
    # dspy.streamify runs the program in a worker thread of its own, which learns of the cancel only when it next
    # runs and hands over a token: how many steps the engine takes before then is the OS's scheduling of that
    # thread (2 usually, 3 in a loaded CI run), so the bound here is "long before the request's 400 tokens end"
    assert_freed_within_one_step(engine, at, steps=LONG // 4)


def test_a_caller_whose_loop_is_gone_is_cancelled(llama_pair) -> None:
    """A task abandoned when its event loop closes never leaves its requests decoding."""
    engine = Engine(llama_pair)
    requests = [Request(p, LargeOnly(), SamplingParams(max_tokens=LONG, ignore_eos=True)) for p in PROMPTS[:4]]
    loop = asyncio.new_event_loop()
    task = loop.create_task(engine.agenerate(requests))

    async def until_running() -> None:
        while not engine.load["running"]:
            await asyncio.sleep(0.002)

    loop.run_until_complete(until_running())
    loop.close()  # the task never finishes; the scheduler's next delivery finds the loop closed
    wait_idle(engine)
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    with contextlib.suppress(RuntimeError):  # finishing the orphaned coroutine needs its (closed) loop
        task.get_coro().close()
