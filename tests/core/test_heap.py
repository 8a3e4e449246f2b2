"""The heap is frozen for cyclic collection while a scheduler thread serves, and given back when the last stops."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from ead_llm import LargeOnly
from ead_llm.core import heap
from ead_llm.core.engine import Engine
from ead_llm.core.heap import frozen_heap, serving
from ead_llm.core.loading import ModelPair
from ead_llm.core.request import Request, SamplingParams


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def idle_heap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No scheduler thread holds the heap (engines of earlier tests may idle in this process: their threads
    only touch the count when they stop, which nothing here does); frozen again afterwards if one did."""
    held = serving()
    monkeypatch.setattr(heap, "_serving", 0)
    gc.unfreeze()
    yield
    monkeypatch.setattr(heap, "_serving", held)
    if held:
        gc.freeze()


def test_nested_uses_count_and_the_last_exit_unfreezes(idle_heap: None) -> None:
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        with frozen_heap():
            assert serving() == 2
        assert serving() == 1
        assert gc.get_freeze_count() > 0  # the outer use still holds it
    assert serving() == 0
    assert gc.get_freeze_count() == 0


def test_a_cycle_that_became_garbage_while_frozen_is_collected_after(idle_heap: None) -> None:
    seen = threading.Event()
    with frozen_heap():
        cycle = Cycle()
        gc.freeze()  # as a second engine starting would: the cycle is now among the frozen objects
        ref = weakref.ref(cycle, lambda _: seen.set())
        del cycle
        gc.collect()
        assert ref() is not None  # frozen: out of reach of the collector
    gc.collect()
    assert ref() is None and seen.is_set()


def test_the_scheduler_thread_holds_the_heap_frozen_while_it_serves(idle_heap: None, llama_pair: ModelPair) -> None:
    """Counted from zero (``idle_heap``), so what is seen is this engine's thread alone: held while it serves, given
    back when it stops."""
    engine = Engine(llama_pair)
    try:
        counts: list[int] = []
        stream = engine.stream([Request("1+2=", LargeOnly(), SamplingParams(max_tokens=4, ignore_eos=True))])
        for _ in stream:
            counts.append(serving())
            assert gc.get_freeze_count() > 0
        assert counts and set(counts) == {1}
    finally:
        assert engine.close()
    assert serving() == 0 and gc.get_freeze_count() == 0
