"""The scheduler: which sequences run, their KV blocks, and what their decoders' actions do.

It owns the waiting queue and the running set (admission first come first served, within
``max_batch`` and the KV budget), asks every running sequence's decoder what it needs from the
step, gives each row the KV blocks its tokens need (preempting the most recently admitted
sequences when the budget is spent: they give their blocks back and wait to be fed again), applies
the decoders' actions (emit, draft, roll back, fork), and after the step retires what finished
and hands the step's events to their callers. It never touches a tensor.
"""

from __future__ import annotations

import math
import queue
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ead_llm.core.kv_cache import KVCache, OutOfBlocks, SequenceKV
from ead_llm.core.model_runner import PassRow
from ead_llm.core.output import OutputProcessor
from ead_llm.core.policy import Decoder
from ead_llm.core.request import SamplingParams
from ead_llm.core.sampler import fork_key
from ead_llm.core.types import (
    Action,
    Draft,
    Emit,
    FinishReason,
    Fork,
    ForwardWork,
    Read,
    Role,
    Rollback,
    RowFailure,
    token_event,
)

if TYPE_CHECKING:
    from ead_llm.core.grammar import SequenceGrammar

HOLD_SHARE = 1.0
"""A step's large-model rows may be held back (:attr:`Scheduler.hold_large`) while they are at most this share of
its small-model rows (16 EAD callers on the embedded pair, one A/B run in one process: 0.5 gained 16%, 1.0 26%, 2.0
24%; docs/results.md has the runs)."""


def should_hold(large_rows: int, small_rows: int, waited: int, hold: int) -> bool:
    """Whether a step leaves its ``large_rows`` rows' pass to the next step: the small model's pass has rows of its
    own to run, the large rows are few beside them (:data:`HOLD_SHARE`), and none has waited ``hold`` steps."""
    return 0 < large_rows <= HOLD_SHARE * small_rows and waited < hold


DONE = object()
"""Delivered after a call's last item, once every request has finished or failed."""
WAKE = object()
"""Delivered to wake a reader blocked on a call (the call was cancelled)."""


@dataclass(eq=False)
class Call:
    """One caller's requests: the scheduler hands their events, failures and the end marker to ``deliver``."""

    queue: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    deliver: Callable[[Any], None] | None = None
    """Where deliveries go (an event loop's queue, for async callers); None: ``queue``."""
    cancelled: bool = False
    fail_fast: bool = True
    """A request's failure ends the whole call (its caller raises); False: the other requests carry on."""
    failed: dict[int, BaseException] = field(default_factory=dict)
    """Requests (by index) that failed; the others carry on."""
    open: dict[int, int] = field(default_factory=dict)
    """Paths not yet finished per request index (its first path, plus those branched off it)."""
    closed: bool = False
    """Whether the end marker was delivered."""
    paths: dict[int, int] = field(default_factory=dict)
    """Paths started per request index."""
    shared: dict[str, Any] = field(default_factory=dict)
    """State the call's decoders share (EAGER's budget)."""
    whole: bool = False
    """The caller reads whole completions (``generate``), not a stream: its items are held and handed over once, when
    the call ends or is cancelled (as a fail-fast call is by a request's failure), instead of once per step (a caller
    thread woken every step competes with the engine for the interpreter: 16 such callers ran 1.3-1.7x faster held)."""
    held: list[Any] = field(default_factory=list)
    """Items of a ``whole`` call not handed over yet (touched under the engine's lock)."""

    def put(self, items: Any) -> None:
        """Hand ``items`` to the caller (thread-safe); a caller that is gone is cancelled."""
        if self.deliver is None:
            self.queue.put(items)
            return
        try:
            self.deliver(items)
        except RuntimeError:  # its event loop is closed: nobody will read this call again
            self.cancelled = True

    def live(self, index: int) -> bool:
        """Whether request ``index`` may still run (not cancelled, not failed)."""
        return not self.cancelled and index not in self.failed

    @property
    def complete(self) -> bool:
        """Every request has finished or failed."""
        return not any(self.open.values())


@dataclass(eq=False)
class Sequence:
    """One path being generated: its tokens, its decoder, its caches, what it has not been billed for."""

    call: Call
    index: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    decoder: Decoder
    key: int
    """Random key of its stream (see :func:`ead_llm.core.sampler.uniforms`)."""
    kv: dict[Role, SequenceKV]
    max_length: int
    """Most positions it may reach: prompt + max_tokens, within the context."""
    eos: frozenset[int]
    output: OutputProcessor | None
    """Its text, when made on the scheduler thread (stop strings, branching); else the caller makes it."""
    path: int = 0
    generated: int = 0
    pending_work: list[ForwardWork] = field(default_factory=list)
    """Passes not billed yet: they go with the next emitted token."""
    finished: bool = False
    admitted: int = 0
    """Admission order (the most recent is preempted first)."""
    branched_from: tuple[int, int] | None = None
    grammar: SequenceGrammar | None = None
    """Its constraint's state (follows ``tokens``), when the request has one."""
    held: int = 0
    """Steps in a row its read of the large model was held back to join a fuller pass (:attr:`Scheduler.hold_large`)."""

    def is_end(self, token: int) -> bool:
        return token in self.eos and not self.params.ignore_eos

    @property
    def live(self) -> bool:
        """Its request may still run (neither cancelled nor failed)."""
        return self.call.live(self.index)


@dataclass(frozen=True)
class PassPlan:
    """One model's pass in a step: the sequences that run (in this order, one row each) and what each reads."""

    role: Role
    seqs: list[Sequence]
    reads: list[Read]

    def rows(self, *, with_target: bool) -> list[PassRow]:
        """The runner's rows (``with_target``: each with its sequence in the large model's cache, for a draft that
        reads the target's hidden states)."""
        return [
            PassRow(
                q.kv[self.role],
                q.tokens,
                r.positions,
                q.kv[Role.LARGE] if with_target else None,
                r.siblings,
                q.prompt_len,
            )
            for q, r in zip(self.seqs, self.reads, strict=True)
        ]


@dataclass(frozen=True)
class SchedulerOutput:
    """What runs in one step: a pass per model that has rows, the large model's first."""

    passes: list[PassPlan]


class Scheduler:
    """See the module docstring. Callers' threads touch only ``waiting`` and call flags, under the
    engine's lock; everything else runs on the scheduler thread."""

    def __init__(self, caches: dict[Role, KVCache], max_batch: int, max_positions: int | None) -> None:
        self.caches = caches
        self.max_batch = max_batch
        self.max_positions = max_positions
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.failed_requests = 0
        self.preemptions = 0
        self.peak_running = 0
        self._admissions = 0
        self._outbox: list[tuple[Call, Any]] = []
        self._touched: dict[Call, None] = {}
        """Calls whose sequences were retired since the last ``finish_step`` (one may now be complete)."""
        self._forks: list[tuple[Sequence, Fork]] = []
        self.prefix_caching = True
        """A sequence admitted starts from the cached blocks of its longest cached prefix (each model's own
        cache), and full blocks of final tokens are cached as they are written."""
        self.hidden_size: int | None = None
        """Set (to the large model's hidden size) when each sequence's last event carries the large model's final
        hidden states (``Engine(return_hidden_states=True)``)."""
        self.hold_large = 1
        """Steps a row's large-model read may wait while the small model's pass runs without it, so that the large
        model's pass gathers more rows: in a step where at most :data:`HOLD_SHARE` as many rows read the large model
        as the small one, and none of them waited already nor branches paths (EAGER: its paths share a budget spent
        in step order, which a held path would reorder), the large pass is left to the next step (the embedded
        large model's pass costs 1.4x one row's at 4 rows, 1.9x at 8). A held row is paused, not changed: the same
        tokens, passes and bill, a step later. 0: never."""

    # -- admission (under the engine's lock) ------------------------------------------------------

    def drop_cancelled(self) -> None:
        """Retire the sequences of cancelled calls and failed requests (their blocks freed)."""
        if not any(not seq.live for seq in [*self.running, *self.waiting]):
            return
        for seq in [*self.running, *self.waiting]:
            if not seq.live:
                seq.finished = True
                self._release(seq)
                self._touched[seq.call] = None
                if seq.index in seq.call.failed:
                    seq.call.open[seq.index] = 0
        self.running = [s for s in self.running if not s.finished]
        self.waiting = deque(s for s in self.waiting if not s.finished)

    @property
    def has_deliveries(self) -> bool:
        """Whether ``finish_step`` has something to hand over even with nothing running."""
        return bool(self._outbox or self._touched)

    def take_outbox(self) -> list[tuple[Call, Any]]:
        """The items not yet delivered (the outbox is emptied)."""
        outbox, self._outbox, self._touched = self._outbox, [], {}
        return outbox

    def admit(self) -> None:
        """Move waiting sequences into the running set, first come first served, while ``max_batch``
        and the KV budget allow (a watermark of free blocks is kept for the running ones to grow)."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            for cache in self.caches.values():
                watermark = math.ceil(0.01 * cache.pool.max_blocks) if cache.pool.max_blocks else 0
                if not cache.can_hold(cache.blocks_for(len(seq.tokens) + 1) + watermark):
                    return
            self.waiting.popleft()
            self._admissions += 1
            seq.admitted = self._admissions
            self.running.append(seq)
            if self.prefix_caching:
                for role, kv in seq.kv.items():
                    if not kv.blocks:
                        self.caches[role].match(kv, seq.tokens)
        self.peak_running = max(self.peak_running, len(self.running))

    @property
    def kv_tokens(self) -> int:
        """KV positions held in blocks, both models together."""
        return sum(cache.tokens_held for cache in self.caches.values())

    # -- one step (the scheduler thread) ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """What runs this step: per model (large first), its rows and what each reads."""
        reads: list[tuple[Sequence, Read]] = []
        for seq in list(self.running):
            try:
                reads.append((seq, seq.decoder.read(seq)))
            except Exception as exc:  # a broken policy fails its own call only
                self.fail(seq, exc)
        passes: dict[Role, list[tuple[Sequence, Read]]] = {}
        preempted = self.preemptions  # while it stays, every row read is still running (no list search per row)
        for seq, read in reads:
            if seq.finished or (self.preemptions != preempted and seq not in self.running):
                continue
            if self._reserve(seq, read.role, len(read.siblings) + max(0, read.chain - 1)):
                passes.setdefault(read.role, []).append((seq, read))
        if self.preemptions != preempted:  # a later row's reservation took an earlier one's place
            passes = {role: [(s, r) for s, r in rows if s in self.running] for role, rows in passes.items()}
        large, small = passes.get(Role.LARGE, []), passes.get(Role.SMALL, [])
        # never held: a pass whose reservations preempted a sequence (the blocks are wanted now), nor a forking
        # decoder's path (its paths share state updated in step order: EAGER's budget)
        may_hold = self.preemptions == preempted and not any(seq.decoder.forks for seq, _ in large)
        waited = max((seq.held for seq, _ in large), default=0)
        if may_hold and should_hold(len(large), len(small), waited, self.hold_large):
            for seq, _ in large:
                seq.held += 1
            large = []
        for seq, _ in large:  # only a row reading the large model can have waited
            seq.held = 0
        plans = [
            PassPlan(role, [seq for seq, _ in rows], [read for _, read in rows])
            for role, rows in ((Role.LARGE, large), (Role.SMALL, small))
            if rows
        ]
        return SchedulerOutput(plans)

    def _reserve(self, seq: Sequence, role: Role, scratch: int = 0) -> bool:
        """Blocks for ``seq``'s tokens in ``role``'s cache (and ``scratch`` positions after them, where a verify
        pass writes the keys of its siblings or a draft chain its later drafts), preempting newer sequences while it
        lacks them; False when ``seq`` itself had to give way."""
        cache = self.caches[role]
        while True:
            try:
                cache.reserve(seq.kv[role], len(seq.tokens) + scratch, seq.max_length)
                return True
            except OutOfBlocks:
                victim = max(self.running, key=lambda s: s.admitted)
                self.preempt(victim)
                if victim is seq:
                    return False

    def preempt(self, seq: Sequence) -> None:
        """Take ``seq``'s caches back; it waits at the head of the queue and is fed again when readmitted."""
        keep = seq.decoder.on_preempt(seq)
        for kv in seq.kv.values():  # what it had seen (dropped drafts too: they are drafted again) and loses
            kv.evicted = max(kv.evicted, kv.length)
        del seq.tokens[keep:]
        if seq.grammar is not None:
            seq.grammar.rollback_to(keep)
        self._release(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def apply(self, seq: Sequence, actions: list[Action]) -> None:
        """Carry out a decoder's actions on ``seq`` (those after its last token are dropped)."""
        forks = []
        for action in actions:
            if seq.finished:
                return
            if isinstance(action, Emit):
                self._emit(seq, action.token, action.role, action.entropy, action.counters)
            elif isinstance(action, Draft):
                if seq.grammar is not None:
                    seq.grammar.accept(action.token, commit=False)
                seq.tokens.append(action.token)
            elif isinstance(action, Rollback):
                if seq.grammar is not None:
                    seq.grammar.rollback_to(action.keep)
                del seq.tokens[action.keep :]
                for role, source, target in action.moves:
                    self.caches[role].move(seq.kv[role], source, target)
                for role, seen in action.seen:
                    self.caches[role].truncate(seq.kv[role], seen)
            elif isinstance(action, Fork):
                forks.append((self._fork(seq), action))
            else:
                raise TypeError(f"unknown decoder action {action!r}")
        for child, fork in forks:
            self._emit(child, fork.token, fork.role, fork.entropy, fork.counters)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """End ``seq``'s request (all its paths) and hand ``exc`` to its caller, once; the call's other requests
        carry on. Blocks are freed at retirement. A request that already finished or failed is left as it is."""
        seq.finished = True
        call = seq.call
        if not seq.live or not call.open.get(seq.index):
            return
        call.failed[seq.index] = exc
        call.open[seq.index] = 0
        self.failed_requests += 1
        self._outbox.append((call, RowFailure(seq.index, exc)))
        if call.fail_fast:  # its caller raises now: the rest of the call retires with this step
            call.cancelled = True

    def fail_all(self, exc: BaseException) -> list[tuple[Call, Any]]:
        """A fault outside any row: every running and waiting request fails with ``exc`` and leaves the queues;
        returns the items not yet delivered (the failures among them)."""
        for seq in [*self.running, *self.waiting]:
            self.fail(seq, exc)
        self.running, self.waiting = [], deque()
        return self.take_outbox()

    def abort(self, exc: BaseException) -> None:
        """Fail every running and waiting request with ``exc``, tell their callers, and start the caches afresh
        (under the engine's lock). Used when the engine closes or its own bookkeeping broke."""
        calls = {seq.call: None for seq in [*self.running, *self.waiting]}
        outbox = self.fail_all(exc)
        for cache in self.caches.values():
            cache.clear()
        for call in calls:  # what a whole-completion call had held goes first: finished requests keep their answers
            if call.held:
                call.put(call.held)
                call.held = []
        for call, item in outbox:
            call.put([item])
        for call in calls:
            if not call.closed:
                call.closed = True
                call.put([DONE])

    def fork_room(self) -> ForkRoom:
        return ForkRoom(self)

    def finish_step(self) -> dict[Call, list[Any]]:
        """Retire what finished or belongs to a failed request or a cancelled call (its blocks freed), then
        return the step's deliveries per call, in order: events and failures, then the end marker of a call
        whose last request just ended. (So a caller that has its answer finds the engine's load without it.)"""
        self.drop_cancelled()
        if self.prefix_caching:
            for seq in self.running:  # finished ones too: their blocks stay cached for the next call
                final = seq.tokens[: seq.prompt_len]  # its prompt's: see KVCache.chunk
                for role, kv in seq.kv.items():
                    self.caches[role].commit(kv, final)
        for seq in self.running:
            if seq.finished:
                self._release(seq)
        self.running = [s for s in self.running if not s.finished]
        touched = self._touched
        out: dict[Call, list[Any]] = {}
        for call, item in self.take_outbox():
            out.setdefault(call, []).append(item)
        for call in touched:
            out.setdefault(call, [])
        for call in list(out):
            if not call.closed and not call.cancelled and call.complete:
                out[call].append(DONE)
                call.closed = True
            if call.whole and not (call.closed or call.cancelled):  # nothing the caller must act on yet
                call.held.extend(out.pop(call))
                continue
            if call.held:
                out[call][:0], call.held = call.held, []
            if not out[call]:
                del out[call]
        if not self.running:
            for cache in self.caches.values():
                cache.trim()
        return out

    # -- helpers ------------------------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        for role, kv in seq.kv.items():
            self.caches[role].free(kv)

    def _hidden_states(self, seq: Sequence) -> torch.Tensor:
        """The large model's final hidden state at each position of ``seq`` fed to it (all but its last token); NaN
        from the first it has not read."""
        assert self.hidden_size is not None
        cache, kv = self.caches[Role.LARGE], seq.kv[Role.LARGE]
        fed = len(seq.tokens) - 1
        seen = min(kv.length, fed)
        read = cache.sequence_features(kv, seen) if seen else None
        if read is not None and seen == fed:
            return read
        out = torch.full(
            (fed, self.hidden_size),
            math.nan,
            dtype=read.dtype if read is not None else torch.float32,
            device=read.device if read is not None else None,
        )
        if read is not None:
            out[:seen] = read
        return out

    def _emit(
        self, seq: Sequence, token: int, role: Role, entropy: float, counters: tuple[tuple[str, int], ...]
    ) -> None:
        if seq.grammar is not None:
            seq.grammar.accept(token, commit=True)
        seq.tokens.append(token)
        seq.generated += 1
        finish: FinishReason | None = None
        if seq.is_end(token):
            finish = FinishReason.STOP
        elif seq.generated >= seq.params.max_tokens or (
            self.max_positions is not None and len(seq.tokens) >= self.max_positions
        ):
            finish = FinishReason.LENGTH
        text = ""
        if seq.output is not None:
            text = seq.output.push(token, last=finish is not None)
            if seq.output.stopped:
                finish = FinishReason.STOP
        first = seq.generated == 1 and seq.path == 0
        event = token_event(
            index=seq.index,
            token_id=token,
            text=text,
            role=role,
            entropy=entropy,
            work=tuple(seq.pending_work),
            finish_reason=finish,
            counters=counters,
            path=seq.path,
            prompt_tokens=seq.prompt_len if first else 0,
            cached_tokens=tuple((r, kv.cached) for r, kv in seq.kv.items() if kv.cached) if first else (),
            branched_from=seq.branched_from
            if seq.branched_from and seq.generated == seq.branched_from[1] + 1
            else None,
            hidden_states=self._hidden_states(seq) if finish is not None and self.hidden_size else None,
        )
        seq.pending_work = []
        if finish is not None:
            seq.finished = True
            seq.call.open[seq.index] -= 1
        self._outbox.append((seq.call, event))

    def _fork(self, parent: Sequence) -> Sequence:
        call = parent.call
        path = call.paths.get(parent.index, 1)
        call.paths[parent.index] = path + 1
        child = Sequence(
            call=call,
            index=parent.index,
            tokens=list(parent.tokens),
            prompt_len=parent.prompt_len,
            params=parent.params,
            decoder=parent.decoder.fork(),
            key=fork_key(parent.key, len(parent.tokens)),
            kv={role: self.caches[role].fork(kv) for role, kv in parent.kv.items()},
            max_length=parent.max_length,
            eos=parent.eos,
            output=None if parent.output is None else parent.output.clone(),
            path=path,
            generated=parent.generated,
            admitted=parent.admitted,
            branched_from=(parent.path, parent.generated),
            grammar=None if parent.grammar is None else parent.grammar.fork(),
        )
        call.open[parent.index] += 1
        self.running.append(child)
        self.peak_running = max(self.peak_running, len(self.running))
        return child


class ForkRoom:
    """Whether one more path may start in this step: a place in the batch, and two free KV blocks per model for
    the copies its first writes make, beyond those already granted to this step's other forks. (A granted fork
    joins the running set at once; its blocks are taken at the next step's reservation.)"""

    BLOCKS_PER_FORK = 2

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.granted = 0

    def take(self) -> bool:
        scheduler = self._scheduler
        blocks = self.BLOCKS_PER_FORK * (self.granted + 1)
        if len(scheduler.running) < scheduler.max_batch and all(
            cache.can_hold(blocks) for cache in scheduler.caches.values()
        ):
            self.granted += 1
            return True
        return False
