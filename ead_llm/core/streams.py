"""What a caller holds while its requests run: the call's events (a sync or an async stream), and the
completions built from them.

The scheduler thread hands each call its items (token events, a request's failure, the end marker)
once per step, or, to a call that reads whole completions (``generate``), once when it ends or is
cancelled. A stream turns them into :class:`TokenEvent` objects on the caller's side, detokenizing
there the sequences the scheduler did not. A request that fails either raises from the stream (the
default: the rest of the call is cancelled) or, with ``isolate``, is recorded in ``failures`` while the
call's other requests go on. Cancelling a stream (``close()``, leaving a loop early, a timeout, or the
cancellation of the task awaiting an async stream) stops its sequences within one engine step.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ead_llm.accounting.ledger import CompletionLedger, Cost, Pricing
from ead_llm.core.output import OutputProcessor
from ead_llm.core.request import Completion, Request
from ead_llm.core.scheduler import DONE, WAKE, Call
from ead_llm.core.types import RowFailure, TokenEvent, with_text

if TYPE_CHECKING:
    from ead_llm.core.frontend import Frontend
    from ead_llm.core.loading import ModelInfo

_END = object()


class _Events:
    """What the sync and async streams share: turning delivered items into events, failures and the end."""

    def __init__(
        self,
        engine: Frontend,
        call: Call,
        processors: dict[int, OutputProcessor],
        timeout_s: float | None,
        *,
        isolate: bool,
    ) -> None:
        self._engine, self._call, self._processors = engine, call, processors
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._isolate = isolate
        self._done = False
        self._buffer: collections.deque[Any] = collections.deque()
        self.failures: dict[int, BaseException] = {}
        """Requests (by index) that failed, with ``isolate``; their events are not yielded."""

    def _remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _timed_out(self) -> TimeoutError:
        self.cancel()
        return TimeoutError(f"the call took longer than {self._timeout_s} s: raise the timeout or lower max_tokens")

    def _take(self, items: Any) -> None:
        self._buffer.extend(items if isinstance(items, list) else [items])

    def _accept(self, item: Any) -> Any:
        """The event to yield for ``item``, None to skip it, or ``_END``; raises a request's failure when not
        isolating (after cancelling the rest of the call)."""
        if item is DONE or item is WAKE:
            self._done = True
            return _END
        if isinstance(item, RowFailure):
            self._fail(item.index, item.error)
            return None
        if item.index in self.failures:
            return None
        processor = self._processors.get(item.index)
        if processor is None:
            return item
        try:
            text = processor.push(item.token_id, last=item.finish_reason is not None)
        except Exception as exc:  # this request's text cannot be made: it fails alone
            self._engine._fail_row(self._call, item.index, exc)
            self._fail(item.index, exc)
            return None
        return with_text(item, text)

    def _fail(self, index: int, error: BaseException) -> None:
        if self._isolate:
            self.failures.setdefault(index, error)
            return
        self.cancel()
        self._done = True
        raise error

    def cancel(self) -> None:
        """Stop the call's sequences (thread-safe); a reader waiting on the stream returns."""
        if not self._done:
            self._engine._cancel(self._call)

    def close(self) -> None:
        """Cancel what is left, if anything (the stream then ends)."""
        self.cancel()
        self._done = True

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.cancel()


class EventStream(_Events, Iterator[TokenEvent]):
    """A call's events, interleaved across its requests and paths, as the scheduler produces them (see the
    module docstring). Past ``timeout_s`` it raises ``TimeoutError`` and cancels."""

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> TokenEvent:
        while not self._done:
            while not self._buffer:
                try:
                    self._take(self._call.queue.get(timeout=self._remaining()))
                except queue.Empty:
                    raise self._timed_out() from None
            event = self._accept(self._buffer.popleft())
            if event is _END:
                break
            if event is not None:
                return event
        raise StopIteration


class AsyncEventStream(_Events, AsyncIterator[TokenEvent]):
    """The async twin of :class:`EventStream`: items arrive on the event loop it was made on (no thread per
    item), and cancelling the task that awaits it cancels the call."""

    def __init__(
        self,
        engine: Frontend,
        call: Call,
        processors: dict[int, OutputProcessor],
        timeout_s: float | None,
        *,
        isolate: bool,
        inbox: asyncio.Queue[Any],
    ) -> None:
        super().__init__(engine, call, processors, timeout_s, isolate=isolate)
        self._inbox = inbox

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> TokenEvent:
        while not self._done:
            while not self._buffer:
                try:
                    self._take(await asyncio.wait_for(self._inbox.get(), self._remaining()))
                except asyncio.TimeoutError:
                    raise self._timed_out() from None
                except BaseException:  # cancelled (or the loop is going away): free the engine now
                    self.close()
                    raise
            event = self._accept(self._buffer.popleft())
            if event is _END:
                break
            if event is not None:
                return event
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.close()


def async_inbox(call: Call, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[Any]:
    """An asyncio queue read on ``loop`` that receives ``call``'s deliveries from the scheduler thread."""
    inbox: asyncio.Queue[Any] = asyncio.Queue()

    def deliver(items: Any) -> None:
        loop.call_soon_threadsafe(inbox.put_nowait, items)

    call.deliver = deliver
    return inbox


class CompletionBuilder:
    """Builds one :class:`Completion` per request from a call's events: a ledger per path, EAGER's vote."""

    def __init__(self, requests: Sequence[Request], info: tuple[ModelInfo, ModelInfo], pricing: Pricing | None) -> None:
        self._requests, self._info, self._pricing = requests, info, pricing
        self._start = time.perf_counter()
        self._ledgers: dict[tuple[int, int], CompletionLedger] = {}
        self._events: dict[tuple[int, int], list[TokenEvent]] = {}
        self._done: dict[int, float] = {}

    def record(self, event: TokenEvent) -> None:
        key = (event.index, event.path)
        if key not in self._ledgers:  # a branched path's events report no prompt: it shares the prefill
            counters = self._requests[event.index].policy.counters()
            self._ledgers[key] = CompletionLedger(*self._info, pricing=self._pricing, counters=counters)
            self._events[key] = []
        self._ledgers[key].record(event)
        self._events[key].append(event)
        if event.finish_reason is not None:
            self._done[event.index] = time.perf_counter() - self._start

    def results(self, failures: dict[int, BaseException]) -> list[Completion | BaseException]:
        """Per request, in order: its completion, or the error it failed with."""
        out: list[Completion | BaseException] = []
        for i, request in enumerate(self._requests):
            if i in failures:
                out.append(failures[i])
                continue
            paths = sorted(path for index, path in self._events if index == i)
            full = {p: _full_path(self._events, i, p) for p in paths}
            costs = [self._ledgers[(i, p)].cost(self._done[i]) for p in paths]
            cost = costs[0] if len(costs) == 1 else Cost.total(costs, wall_time_s=self._done[i])
            chosen, votes = request.policy.select(["".join(e.text for e in full[p]) for p in paths])
            out.append(_completion(i, full[paths[chosen]], cost, paths[chosen], len(paths), votes))
        return out


def _full_path(events: dict[tuple[int, int], list[TokenEvent]], index: int, path: int) -> list[TokenEvent]:
    """A path's events preceded by those it shares with its parents (a branched path's prefix)."""
    own = events[(index, path)]
    origin = own[0].branched_from
    if origin is None:
        return own
    parent, shared = origin
    return [*_full_path(events, index, parent)[:shared], *own]


def _completion(
    index: int, events: list[TokenEvent], cost: Cost, path: int, paths: int, votes: dict[str, int] | None
) -> Completion:
    finish = events[-1].finish_reason
    assert finish is not None
    return Completion(
        index=index,
        text="".join(e.text for e in events),
        token_ids=tuple(e.token_id for e in events),
        roles=tuple(e.role for e in events),
        entropies=tuple(e.entropy for e in events),
        finish_reason=finish,
        cost=cost,
        path=path,
        paths=paths,
        votes=votes,
        hidden_states=events[-1].hidden_states,
    )
