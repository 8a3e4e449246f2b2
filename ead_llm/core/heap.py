"""The Python heap while an engine serves: what existed when it started is left out of cyclic garbage collection.

The step loop makes small objects every token (events, tuples, lists), so the collector runs dozens of times per
call, and each full collection walks every object the process holds: a loaded pair, transformers and torch are
hundreds of thousands. :func:`frozen_heap` moves those into the collector's permanent generation (``gc.freeze``,
as vLLM's engine core does after loading) while any engine's scheduler thread runs, and gives them back
(``gc.unfreeze``) when the last one stops, so that a cycle that became garbage meanwhile is collected then. Objects
made while it is frozen are collected as usual. Measured on the embedded pair, 64 EAD rows (one thread): time in
the collector 0.124 -> 0.027 s per 3 s call.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_serving = 0


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap for the duration (nested and concurrent uses count; the last exit unfreezes)."""
    global _serving
    with _lock:
        _serving += 1
        gc.freeze()  # O(1): each entry also freezes what was made since the last (a second engine's weights)
    try:
        yield
    finally:
        with _lock:
            _serving -= 1
            if _serving == 0:
                gc.unfreeze()


def serving() -> int:
    """How many scheduler threads hold the heap frozen now."""
    return _serving
