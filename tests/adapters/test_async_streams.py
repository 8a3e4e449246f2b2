"""Async streams: a consumer cancelled while a token is being fetched never closes a running generator."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from ead_llm import EntropyAdaptiveLLM
from ead_llm.adapters.pair_model import iterate_in_thread
from ead_llm.evaluation.task import problems


def test_cancelling_during_a_fetch_waits_for_it_before_closing() -> None:
    fetching, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def slow() -> Iterator[int]:
        try:
            yield 1
            fetching.set()
            release.wait(timeout=10)  # the worker thread is inside next() here
            yield 2
        finally:
            seen.append("closed")

    async def main() -> None:
        async def consume() -> None:
            async for _ in iterate_in_thread(slow()):
                pass

        task = asyncio.create_task(consume())
        await asyncio.to_thread(fetching.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        release.set()  # the fetch returns; only then is the generator closed
        try:
            await task
        except asyncio.CancelledError:
            seen.append("cancelled")

    asyncio.run(main())
    # closing a generator while it runs would raise ValueError("generator already executing")
    assert seen == ["closed", "cancelled"]


def test_a_cancelled_astream_frees_its_sequence() -> None:
    llm = EntropyAdaptiveLLM(max_tokens=400)
    prompt = problems("test", 1)[0].prompt

    async def main() -> int:
        got = 0

        async def consume() -> None:
            nonlocal got
            async for _ in llm.astream(prompt):
                got += 1

        task = asyncio.create_task(consume())
        while got < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return got

    assert asyncio.run(main()) >= 3
    engine = llm.shared_engine
    for _ in range(500):  # cancellation reaches the scheduler at its next step
        if engine.load["running"] == 0:
            break
        threading.Event().wait(0.01)
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
