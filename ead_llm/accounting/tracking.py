"""``track_cost()``: sum the cost of every call made inside a ``with`` block, in the spirit of
LangChain's ``get_openai_callback``.

Every adapter (LangChain LLM, chat model, DSPy LM) reports each finished call here. A block sees
the calls made in its context: nested chains, LangChain's ``batch`` workers and async tasks
(which copy the context), and DSPy's ``Parallel``/``Evaluate`` workers (which copy DSPy's
settings, where the tracker is also registered). A thread you start yourself is counted when it
runs in a copy of the context (``contextvars.copy_context().run``). Blocks nest: an inner call
counts in every enclosing block. Cache hits cost nothing and are not counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ead_llm.accounting.ledger import Cost

_TRACKERS: ContextVar[tuple[CostTracker, ...]] = ContextVar("ead_llm_cost_trackers", default=())
_DSPY_KEY = "ead_llm_cost_trackers"


class CostTracker:
    """Running totals of the calls made inside one ``track_cost()`` block; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._costs: list[Cost] = []
        self._wall_time_s = 0.0

    def add(self, cost: Cost) -> None:
        """Count one call (its summed cost; its wall time adds to the block's total)."""
        with self._lock:
            self._costs.append(cost)
            self._wall_time_s += cost.wall_time_s

    @property
    def calls(self) -> int:
        """How many calls were counted."""
        with self._lock:
            return len(self._costs)

    @property
    def cost(self) -> dict[str, Any]:
        """The cost dict summed over every counted call (``wall_time_s`` is the sum of call times)."""
        with self._lock:
            if not self._costs:
                return {}
            return Cost.total(self._costs, wall_time_s=self._wall_time_s).to_dict()

    @property
    def cost_usd(self) -> float | None:
        """USD of the counted calls; None when no prices were set (``pricing=``) or nothing was counted."""
        return self.cost.get("cost_usd")

    def __getattr__(self, name: str) -> Any:
        """``tracker.large_tokens`` etc.: any key of the summed cost dict."""
        if name.startswith("_"):
            raise AttributeError(name)
        cost = self.cost
        if name in cost:
            return cost[name]
        if not cost:
            return 0
        raise AttributeError(f"no cost key {name!r}; keys: {sorted(cost)}")

    def __repr__(self) -> str:
        return f"CostTracker(calls={self.calls}, cost={self.cost})"


def _dspy_trackers() -> tuple[CostTracker, ...]:
    from dspy.dsp.utils.settings import settings

    found = settings.get(_DSPY_KEY, ())
    return found if isinstance(found, tuple) else ()


@contextmanager
def track_cost() -> Iterator[CostTracker]:
    """Yield a :class:`CostTracker` that sums the cost dicts of every call made inside the block."""
    import dspy

    tracker = CostTracker()
    outer = active_trackers()
    token = _TRACKERS.set((*outer, tracker))
    try:
        with dspy.context(**{_DSPY_KEY: (*outer, tracker)}):
            yield tracker
    finally:
        _TRACKERS.reset(token)


def active_trackers() -> tuple[CostTracker, ...]:
    """The trackers of every open block this context sees, outermost first, each once."""
    seen: dict[int, CostTracker] = {}
    for tracker in (*_TRACKERS.get(), *_dspy_trackers()):
        seen.setdefault(id(tracker), tracker)
    return tuple(seen.values())


def report(cost: Cost) -> None:
    """Count one finished call in every open block."""
    for tracker in active_trackers():
        tracker.add(cost)
