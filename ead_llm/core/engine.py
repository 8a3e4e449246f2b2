"""The engine: one loaded pair shared by every caller, decoding step by step under a policy.

A scheduler thread runs the step loop for all callers at once. Each step it asks every live
sequence's policy which model produces its next token, groups the sequences by that model, has
the model's runner return next-token logits for the whole group in one batched pass (catching
each sequence's cache up on what it has not seen), samples each row with its own generator, and
hands each caller one :class:`TokenEvent` per emitted token. Text, stop strings, the ledger and
the framework adapters all consume that one stream.
"""

from __future__ import annotations

import atexit
import math
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tenacity import Retrying, stop_after_attempt, wait_none

from ead_llm.accounting.ledger import CompletionLedger, Cost, Pricing
from ead_llm.core.loading import LoadConfig, ModelPair
from ead_llm.core.model_runner import ForwardRow, KVPool, ModelCache, ModelRunner
from ead_llm.core.ops import entropy_bits, top_k_entropy_nats
from ead_llm.core.output import IncrementalDetokenizer, StopMatcher
from ead_llm.core.request import Completion, Prompt, Request, SamplingParams, sequence_key
from ead_llm.core.sampler import Sampler, request_generator
from ead_llm.core.types import FinishReason, ForwardWork, Role, TokenEvent
from ead_llm.core.validation import check_float, check_int
from ead_llm.policies.base import Policy
from ead_llm.policies.eager import EAGER
from ead_llm.policies.speculative import SpeculativeDecoding

_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    for engine in list(_ENGINES):
        engine.close()


_DONE = object()
"""Put on a call's queue once every path of every request of the call has finished."""


@dataclass
class _Call:
    """One caller's requests: the scheduler puts their events (or a failure) on ``queue``."""

    queue: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    failed: bool = False
    open: int = 0
    """Paths not yet finished (requests, plus the paths EAGER branches off); changed by the scheduler."""


@dataclass
class _Group:
    """The paths of one EAGER request, and what its branching rule needs."""

    policy: EAGER
    budget: _Budget
    paths: int = 1
    branches: int = 0
    entropies: list[float] = field(default_factory=list)
    since_branch: int = 0


@dataclass
class _Budget:
    """A call's EAGER prompts and the paths they hold together."""

    prompts: int = 0
    paths: int = 0


@dataclass
class _Sequence:
    call: _Call
    index: int
    tokens: list[int]
    prompt_len: int
    reserve: int
    """KV positions this sequence may need (prompt and max_tokens, within the context limit)."""
    policy: Policy
    state: Any
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    stops: StopMatcher
    caches: dict[Role, ModelCache]
    slot: int = -1
    generated: int = 0
    finished: bool = False
    drafts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """A speculative round's drafts so far, with the small model's logits each was drawn from."""
    pending_work: list[ForwardWork] = field(default_factory=list)
    """Forward passes of the round's drafts, charged to the round's first emitted token."""
    path: int = 0
    """Which path of its request (EAGER branches; 0 otherwise)."""
    group: _Group | None = None

    def release(self) -> None:
        for cache in self.caches.values():
            cache.release()


def _check_requests(requests: Sequence[Request]) -> None:
    if isinstance(requests, (str, Request)):
        raise ValueError("requests must be a list of Request objects")
    for request in requests:
        if not isinstance(request, Request):
            raise ValueError(f"requests must be Request objects, got {request!r}")


class Engine:
    """Decodes requests on a loaded pair for any number of callers (threads or async tasks).

    A scheduler thread owns the models. Callers' requests queue and join the running batch
    (continuous batching): each step, every live sequence's policy names the model it needs, the
    sequences are grouped by model, each group runs as one batched forward pass, and each caller
    gets its own events. At most ``max_batch`` sequences run at once and their reserved KV
    positions (prompt plus ``max_tokens``) stay within ``kv_budget_tokens``; the rest wait. A
    sequence's randomness is its own (seed and row), so its text does not depend on what else runs
    (up to floating-point rounding of batched kernels, which can flip an exact tie).
    """

    def __init__(self, pair: ModelPair, max_batch: int = 64, kv_budget_tokens: int | None = None) -> None:
        self.pair = pair
        self.tokenizer = pair.tokenizer
        limits = [m.info.max_positions for m in (pair.small, pair.large) if m.info.max_positions]
        self.max_positions: int | None = min(limits) if limits else None
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        if kv_budget_tokens is not None:
            check_int("kv_budget_tokens", kv_budget_tokens, minimum=1)
        self.kv_budget_tokens = kv_budget_tokens
        self.runners = {
            role: ModelRunner(pair.model(role), pair.device, pair.vocab_size, max_batch, self.max_positions)
            for role in Role
        }
        self.sampler = Sampler()
        self.faults = {"retried_passes": 0, "failed_requests": 0}
        """Passes retried in smaller batches, and requests failed by a fault (not cancelled), so far."""
        self.load_config: LoadConfig | None = None
        """Set by the registry: how to load this pair again (pickling an object that holds the engine
        stores this instead of the weights)."""
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._live: list[_Sequence] = []
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._reserved = 0
        self._thread: threading.Thread | None = None
        self._closing = False
        _ENGINES.add(self)

    def __reduce__(self) -> tuple[Any, tuple[LoadConfig]]:
        """Pickled as the pair's load settings; unpickling finds (or loads) the shared engine."""
        if self.load_config is None:
            raise TypeError("this Engine was built from a ModelPair directly; only shared engines can be pickled")
        from ead_llm.core.registry import shared_engine

        return shared_engine, (self.load_config,)

    def __copy__(self) -> Engine:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Engine:
        """The engine is a shared resource: copying an object that holds it never clones the weights."""
        return self

    # -- prompts ---------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (special tokens as the tokenizer adds them; BOS for an empty prompt)."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.pair.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.pair.vocab_size - 1})")
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise ValueError("prompt must not be empty: this tokenizer has no BOS token to start from")
            ids = [int(bos)]
        return ids

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids a request decodes from: its encoded prompt, left-truncated to fit the context
        when the request asks for it, else refused when it leaves no room for a new token."""
        ids = self.encode(request.prompt)
        limit = self.max_positions
        if limit is None or len(ids) < limit:
            return ids
        if request.sampling.prompt_truncation == "error":
            raise ValueError(
                f"prompt has {len(ids)} tokens but the models accept at most {limit} positions in all: "
                "shorten the prompt, or pass prompt_truncation='left' to drop its oldest tokens"
            )
        keep = max(1, limit - request.sampling.max_tokens)
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[0] == bos and keep > 1:
            return [ids[0], *ids[len(ids) - keep + 1 :]]
        return ids[len(ids) - keep :]

    # -- callers ---------------------------------------------------------------------------------

    def _sequence(self, call: _Call, index: int, request: Request) -> _Sequence:
        ids = self.prompt_ids(request)
        reserve = len(ids) + request.sampling.max_tokens
        if self.max_positions is not None:
            reserve = min(reserve, self.max_positions)
        if self.kv_budget_tokens is not None and reserve > self.kv_budget_tokens:
            raise ValueError(
                f"a request needs up to {reserve} KV positions (prompt {len(ids)} + max_tokens "
                f"{request.sampling.max_tokens}) but kv_budget_tokens is {self.kv_budget_tokens}: "
                "lower max_tokens or raise the budget"
            )
        params = request.sampling
        stream = index if request.sample_index is None else request.sample_index
        if isinstance(request.policy, EAGER):
            params = replace(params, temperature=request.policy.temperature)
        return _Sequence(
            call=call,
            index=index,
            tokens=ids,
            prompt_len=len(ids),
            reserve=reserve,
            policy=request.policy,
            state=request.policy.start_sequence(sequence_key(ids, request.sample_index or 0)),
            params=params,
            generator=request_generator(request.sampling.seed, stream),
            detok=IncrementalDetokenizer(self.tokenizer, ids),
            stops=StopMatcher(request.sampling.stop),
            caches={role: ModelCache() for role in Role},
        )

    def stream(self, requests: Sequence[Request], timeout_s: float | None = None) -> Generator[TokenEvent, None, None]:
        """Yield one event per generated token of every request, interleaved across requests.

        Requests are checked (and prompts encoded) before anything is queued. Closing the iterator
        early cancels the requests and frees their caches; so does ``timeout_s`` (seconds from the
        call, waiting included), which then raises ``TimeoutError``.
        """
        _check_requests(requests)
        if timeout_s is not None:
            check_float("timeout_s", timeout_s, minimum=0.0, exclusive_minimum=True)
        if not requests:
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        call = _Call()
        sequences = [self._sequence(call, i, r) for i, r in enumerate(requests)]
        call.open = len(sequences)
        budget = _Budget()
        for seq in sequences:
            if isinstance(seq.policy, EAGER):
                budget.prompts += 1
                budget.paths += 1
                seq.group = _Group(seq.policy, budget)
        with self._cond:
            self._waiting.extend(sequences)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ead-llm-engine", daemon=True)
                self._thread.start()
            self._cond.notify()
        done = False
        try:
            while True:
                try:
                    item = call.queue.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"the call took longer than {timeout_s} s: raise the timeout or lower max_tokens"
                    ) from None
                if item is _DONE:
                    done = True
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not done:
                with self._cond:
                    call.cancelled = True
                    self._cond.notify()

    def set_limits(self, max_batch: int | None = None, kv_budget_tokens: int | None = None) -> None:
        """Change the scheduler's limits (``None`` keeps one). Only while nothing runs or waits."""
        if max_batch is not None:
            check_int("max_batch", max_batch, minimum=1)
        if kv_budget_tokens is not None:
            check_int("kv_budget_tokens", kv_budget_tokens, minimum=1)
        with self._cond:
            if max_batch in (None, self.max_batch) and kv_budget_tokens in (None, self.kv_budget_tokens):
                return
            if self._live or self._waiting:
                raise RuntimeError("the engine's limits can only change while it is idle")
            if kv_budget_tokens is not None:
                self.kv_budget_tokens = kv_budget_tokens
            if max_batch is not None and max_batch != self.max_batch:
                self.max_batch = max_batch
                self._free_slots = list(range(max_batch - 1, -1, -1))
                for runner in self.runners.values():
                    runner.pool = KVPool(max_batch, self.max_positions, runner.pool.layers)

    def close(self) -> None:
        """Stop the scheduler thread (cancelling whatever runs or waits); called at interpreter exit.

        Stopping it then, rather than leaving a daemon thread inside torch while the interpreter
        tears down, avoids an abort at exit. A later call starts the thread again.
        """
        with self._cond:
            thread, self._closing = self._thread, True
            for seq in [*self._live, *self._waiting]:
                if not seq.call.failed:
                    seq.call.failed = True
                    seq.call.queue.put(RuntimeError("the engine was closed"))
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        with self._cond:
            self._thread, self._closing = None, False

    @property
    def load(self) -> dict[str, int]:
        """Sequences running and waiting, and the KV positions reserved by the running ones."""
        with self._cond:
            return {"running": len(self._live), "waiting": len(self._waiting), "reserved_kv": self._reserved}

    # -- the scheduler ---------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    self._drop_cancelled()
                    self._admit()
                    while not self._live and not self._closing:
                        self._cond.wait()
                        self._drop_cancelled()
                        self._admit()
                    if self._closing:
                        return
                    live = list(self._live)
                self._step(live)
                with self._cond:
                    for seq in [s for s in self._live if s.finished]:
                        self._retire(seq)

    def _retire(self, seq: _Sequence) -> None:
        """Free a running sequence's slot and reservation (call with the condition held)."""
        if seq in self._live:
            self._live.remove(seq)
            self._free_slots.append(seq.slot)
            self._reserved -= seq.reserve
        seq.release()

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._live if s.call.cancelled or s.call.failed]:
            seq.finished = True
            self._retire(seq)
        self._waiting = deque(s for s in self._waiting if not (s.call.cancelled or s.call.failed))

    def _admit(self) -> None:
        """Move waiting sequences into the batch, first come first served, while slots and budget allow."""
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            if self.kv_budget_tokens is not None and self._reserved + seq.reserve > self.kv_budget_tokens:
                return
            self._waiting.popleft()
            seq.slot = self._free_slots.pop()
            self._reserved += seq.reserve
            self._live.append(seq)

    def _step(self, live: list[_Sequence]) -> None:
        # one pass per (model, kind): decodes feed one token a row, catch-ups (prefill, or the gap after
        # a switch) several, so a catch-up never pads every decode row to its width; verifications
        # (speculative rounds) need logits at every new position
        groups: dict[tuple[Role, str], list[_Sequence]] = {}
        for seq in live:
            speculative = isinstance(seq.policy, SpeculativeDecoding)
            if speculative and not seq.drafts:
                seq.state = seq.policy.begin_round(seq.state, self._draft_budget(seq))  # type: ignore[attr-defined]
            role = seq.policy.choose(seq.state)
            if speculative and role is Role.LARGE:
                kind = "verify"
            else:
                kind = "catch-up" if len(seq.tokens) - seq.caches[role].seen > 1 else "decode"
            groups.setdefault((role, kind), []).append(seq)
        for (role, kind), group in sorted(groups.items(), key=lambda item: (item[0][0].value, item[0][1])):
            for seq, row_logits, row_work, entropy in self._forward_group(role, kind, group):
                try:
                    if kind == "verify":
                        self._verify(seq, row_logits, row_work)
                    else:
                        self._next_token(seq, role, row_logits, row_work, entropy)
                except Exception as exc:  # this request fails; everyone else carries on
                    self._fail(seq, exc)

    def _forward_group(
        self, role: Role, kind: str, group: list[_Sequence]
    ) -> list[tuple[_Sequence, torch.Tensor, ForwardWork, float]]:
        """One batched pass of ``role`` over ``group``: each sequence with its logits ([V], or [n, V] to
        verify), work and next-token entropy (bits; NaN when verifying), in group order.

        When a pass raises (out of memory, or a fault one row triggers), tenacity retries the rows not
        yet done in passes half as large, down to one row; a row that fails alone fails only its own
        request. Rows are safe to re-run: a pass writes keys at true positions and advances a cache
        only when it succeeds.
        """
        runner = self.runners[role]
        done: dict[int, tuple[torch.Tensor, ForwardWork, float]] = {}
        failed: set[int] = set()

        def run_in_passes(size: int) -> None:
            pending = [i for i in range(len(group)) if i not in done and i not in failed]
            for first in range(0, len(pending), size):
                chunk = pending[first : first + size]
                rows = [ForwardRow(group[i].slot, group[i].caches[role], group[i].tokens) for i in chunk]
                try:
                    if kind == "verify":
                        per_row, work = runner.forward_all(rows)
                        entropies = [math.nan] * len(rows)
                    else:
                        logits, work = runner.forward(rows)  # logits: [B, V]
                        per_row, entropies = list(logits), entropy_bits(logits).tolist()  # [B]
                except Exception as exc:
                    if size > 1:
                        self.faults["retried_passes"] += 1
                        raise
                    failed.add(chunk[0])
                    self._fail(group[chunk[0]], exc)
                    continue
                done.update(zip(chunk, zip(per_row, work, entropies, strict=True), strict=True))

        retrying = Retrying(
            stop=stop_after_attempt(len(group).bit_length() + 1),
            wait=wait_none(),
            before_sleep=lambda _: self._free_device_memory(),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                run_in_passes(max(1, math.ceil(len(group) / 2 ** (attempt.retry_state.attempt_number - 1))))
        return [(group[i], *done[i]) for i in range(len(group)) if i in done]

    def _free_device_memory(self) -> None:
        if self.pair.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fail(self, seq: _Sequence, exc: BaseException) -> None:
        """End ``seq`` and hand ``exc`` to its caller (once per call); the scheduler frees its slot."""
        seq.finished = True
        self.faults["failed_requests"] += 1
        if not seq.call.failed:
            seq.call.failed = True
            seq.call.queue.put(exc)

    def _next_token(
        self, seq: _Sequence, role: Role, row_logits: torch.Tensor, row_work: ForwardWork, entropy: float
    ) -> None:
        """Sample, draft or withhold ``seq``'s next token from ``role``'s logits, and emit what is emitted."""
        if not isinstance(seq.policy, SpeculativeDecoding) and self._preempted(seq, role, entropy):
            seq.pending_work.append(row_work)  # billed with the token the other model writes
            return
        token = self.sampler.sample(row_logits, seq.params, seq.generator)
        seq.state = seq.policy.advance(seq.state, role, entropy)
        if isinstance(seq.policy, SpeculativeDecoding):
            seq.tokens.append(token)  # a draft: emitted only if verification keeps it
            seq.drafts.append((token, row_logits))
            seq.pending_work.append(row_work)
            if token in self.pair.eos_token_ids and not seq.params.ignore_eos:
                seq.state = seq.policy.cut_round(seq.state)
            return
        preempted = len(seq.pending_work)
        row_works, seq.pending_work = (*seq.pending_work, row_work), []
        counters = (("preempted_tokens", preempted),) if preempted else ()
        if seq.group is not None:
            self._eager_token(seq, token, row_logits, role, entropy, row_works, counters)
        else:
            self._deliver(seq, self._emit(seq, token, role, entropy, row_works, counters))

    @staticmethod
    def _deliver(seq: _Sequence, event: TokenEvent) -> None:
        """Hand an event to its caller; after a call's last open path finishes, say so."""
        seq.call.queue.put(event)
        if event.finish_reason is not None:
            seq.call.open -= 1
            if seq.call.open == 0:
                seq.call.queue.put(_DONE)

    @staticmethod
    def _preempted(seq: _Sequence, role: Role, entropy: float) -> bool:
        """Whether the policy withholds ``role``'s token at this position (its state then names the
        other model, which writes the position next step); a revision keeping ``role`` is ignored."""
        revised = seq.policy.preempt(seq.state, role, entropy)
        if revised is None or seq.policy.choose(revised) is role:
            return False
        seq.state = revised
        return True

    def _eager_token(
        self,
        seq: _Sequence,
        token: int,
        logits: torch.Tensor,
        role: Role,
        entropy: float,
        work: tuple[ForwardWork, ...],
        counters: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """Emit an EAGER path's token, first branching a new path off it when the rule says so."""
        group = seq.group
        assert group is not None
        policy = group.policy
        nats = float(top_k_entropy_nats(logits, policy.top_k))
        group.since_branch += 1
        branch = policy.should_branch(
            nats, group.entropies, group.since_branch, group.paths, group.budget.paths, group.budget.prompts
        )
        group.entropies.append(nats)
        child = None
        if branch and not seq.finished:
            first, second = torch.topk(logits, 2).indices.tolist()
            child = self._spawn(seq)
            if child is not None:
                token = first
                group.paths += 1
                group.branches += 1
                group.budget.paths += 1
                group.since_branch = 0
        if seq.generated == 0 and seq.path == 0:
            counters = (*counters, ("paths", 1))
        self._deliver(seq, self._emit(seq, token, role, entropy, work, counters))
        if child is not None:
            self._deliver(child, self._emit(child, second, role, entropy, (), (("paths", 1), ("branches", 1))))

    def _spawn(self, parent: _Sequence) -> _Sequence | None:
        """A new path from ``parent``'s prefix (its KV copied into a free slot), or None when none is free."""
        with self._cond:
            budget = self.kv_budget_tokens
            if not self._free_slots or (budget is not None and self._reserved + parent.reserve > budget):
                return None
            slot = self._free_slots.pop()
            self._reserved += parent.reserve
            caches = {role: ModelCache() for role in Role}
            for role, cache in caches.items():
                cache.seen = parent.caches[role].seen
            assert parent.group is not None
            child = _Sequence(
                call=parent.call,
                index=parent.index,
                tokens=list(parent.tokens),
                prompt_len=parent.prompt_len,
                reserve=parent.reserve,
                policy=parent.policy,
                state=parent.state,
                params=parent.params,
                generator=torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=parent.generator))),
                detok=parent.detok.clone(),
                stops=parent.stops.clone(),
                caches=caches,
                slot=slot,
                generated=parent.generated,
                path=parent.group.paths,
                group=parent.group,
            )
            self._live.append(child)
            parent.call.open += 1
        for role, runner in self.runners.items():
            if runner.pool.keys and caches[role].seen:
                runner.pool.copy_slot(parent.slot, slot, caches[role].seen)
        return child

    def _draft_budget(self, seq: _Sequence) -> int:
        """Drafts a round may make so that the round's tokens fit max_tokens and the context."""
        budget = seq.params.max_tokens - seq.generated - 1
        if self.max_positions is not None:
            budget = min(budget, self.max_positions - len(seq.tokens) - 1)
        return max(0, budget)

    def _verify(self, seq: _Sequence, large_logits: torch.Tensor, work: ForwardWork) -> None:
        """Judge a speculative round, roll both caches back to what stands, emit the round's tokens."""
        policy = seq.policy
        assert isinstance(policy, SpeculativeDecoding)
        drafts = [token for token, _ in seq.drafts]
        gamma = len(drafts)
        verify_logits = large_logits[-(gamma + 1) :]  # [gamma + 1, V]
        small_logits = torch.stack([logits for _, logits in seq.drafts]) if drafts else verify_logits[:0]  # [gamma, V]
        verdict = policy.judge(drafts, small_logits, verify_logits, seq.params, seq.generator)
        prefix = len(seq.tokens) - gamma
        del seq.tokens[prefix:]
        # with no closing token the large model must re-read the last kept draft next round: its
        # logits there are what the next round's first draft is judged against
        seq.caches[Role.LARGE].seen = prefix + verdict.accepted - (1 if verdict.token is None else 0)
        seq.caches[Role.SMALL].seen = min(seq.caches[Role.SMALL].seen, prefix + verdict.accepted)
        seq.state = policy.end_round(seq.state, gamma, verdict.accepted)
        round_work = (*seq.pending_work, work)
        counters = (
            ("drafted_tokens", gamma),
            ("accepted_tokens", verdict.accepted),
            ("entropy_rejections", verdict.entropy_rejections),
        )
        seq.drafts, seq.pending_work = [], []
        small_h = entropy_bits(small_logits).tolist() if drafts else []
        large_h = entropy_bits(verify_logits).tolist()
        emitted = [(token, Role.SMALL, small_h[i]) for i, token in enumerate(drafts[: verdict.accepted])]
        if verdict.token is not None:
            emitted.append((verdict.token, Role.LARGE, large_h[verdict.accepted]))
        for i, (token, role, entropy) in enumerate(emitted):
            first = i == 0
            event = self._emit(seq, token, role, entropy, round_work if first else (), counters if first else ())
            self._deliver(seq, event)
            if seq.finished:
                return

    def _emit(
        self,
        seq: _Sequence,
        token: int,
        role: Role,
        entropy: float,
        work: tuple[ForwardWork, ...],
        counters: tuple[tuple[str, int], ...] = (),
    ) -> TokenEvent:
        seq.tokens.append(token)
        seq.generated += 1
        text = seq.stops.push(seq.detok.push(token))
        finish: FinishReason | None = None
        if seq.stops.matched or (token in self.pair.eos_token_ids and not seq.params.ignore_eos):
            finish = FinishReason.STOP
        elif seq.generated >= seq.params.max_tokens or (
            self.max_positions is not None and len(seq.tokens) >= self.max_positions
        ):
            finish = FinishReason.LENGTH
        if finish is not None and not seq.stops.matched:
            text += seq.stops.push(seq.detok.flush())
            if seq.stops.matched:
                finish = FinishReason.STOP
            else:
                text += seq.stops.flush()
        if finish is not None:
            seq.finished = True
            seq.release()
        return TokenEvent(
            index=seq.index,
            token_id=token,
            text=text,
            role=role,
            entropy=entropy,
            work=work,
            finish_reason=finish,
            counters=counters,
            path=seq.path,
            prompt_tokens=seq.prompt_len if seq.generated == 1 and seq.path == 0 else 0,
        )

    def generate(
        self, requests: Sequence[Request], pricing: Pricing | None = None, timeout_s: float | None = None
    ) -> list[Completion]:
        """Run requests to completion and return one :class:`Completion` per request, in order.

        With ``timeout_s``, a call still running after that many seconds raises ``TimeoutError``;
        its sequences' caches are freed.
        """
        _check_requests(requests)
        start = time.perf_counter()
        info = (self.pair.small.info, self.pair.large.info)
        ledgers: dict[tuple[int, int], CompletionLedger] = {}
        events: dict[tuple[int, int], list[TokenEvent]] = {}
        done: dict[int, float] = {}
        for event in self.stream(requests, timeout_s):
            key = (event.index, event.path)
            if key not in ledgers:  # a branched path's events report no prompt: it shares the prefill
                ledgers[key] = CompletionLedger(*info, pricing=pricing)
                events[key] = []
            ledgers[key].record(event)
            events[key].append(event)
            if event.finish_reason is not None:
                done[event.index] = time.perf_counter() - start
        out = []
        for i, request in enumerate(requests):
            paths = sorted(path for index, path in events if index == i)
            costs = [ledgers[(i, p)].cost(done[i]) for p in paths]
            cost = costs[0] if len(costs) == 1 else Cost.total(costs, wall_time_s=done[i])
            if isinstance(request.policy, EAGER):
                texts = ["".join(e.text for e in events[(i, p)]) for p in paths]
                chosen, votes = request.policy.vote(texts)
                out.append(self._completion(i, events[(i, paths[chosen])], cost, votes=votes, paths=len(paths)))
            else:
                out.append(self._completion(i, events[(i, 0)], cost))
        return out

    @staticmethod
    def _completion(
        index: int, events: list[TokenEvent], cost: Cost, votes: dict[str, int] | None = None, paths: int = 1
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
            path=events[0].path,
            paths=paths,
            votes=votes,
        )
