"""Async streams: a consumer that stops frees its sequence."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from ead_llm import EntropyAdaptiveLLM
from ead_llm.evaluation.task import problems


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
