"""How callers reach the engine: requests in (checked and encoded before anything is queued), events out as a
sync or an async stream, or whole completions (the one result type, billed by the ledger as events arrive).

:class:`Frontend` is the engine's caller side; :class:`~ead_llm.core.engine.Engine` adds the step and the
scheduler thread that runs it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, overload

from ead_llm.accounting.ledger import Pricing
from ead_llm.core.fused_draft import reads_features
from ead_llm.core.grammar import GrammarCompiler
from ead_llm.core.inputs import InputProcessor, check_requests
from ead_llm.core.kv_cache import KVCache
from ead_llm.core.loading import LoadConfig, ModelPair
from ead_llm.core.model_runner import ModelRunner
from ead_llm.core.output import OutputProcessor
from ead_llm.core.request import Completion, Prompt, Request
from ead_llm.core.scheduler import WAKE, Call, Scheduler
from ead_llm.core.scheduler import Sequence as Seq
from ead_llm.core.streams import AsyncEventStream, CompletionBuilder, EventStream, async_inbox
from ead_llm.core.types import Role
from ead_llm.core.validation import check_float, check_int

StreamT = TypeVar("StreamT", EventStream, AsyncEventStream)
logger = logging.getLogger(__name__)
EXACT_MIN_PARAMETERS = 50_000_000
"""Large models from this many parameters verify exactly by default. What exactness costs is a fixed few us per
verified token per layer in the attention kernel, so it depends on how much the forward costs beside it (one
thread, speculative decoding, against the default in the same process): SmolLM2-135M 0.97-1.00x one request at a
time and 0.94-1.00x at 16 rows; the embedded pair's 3.4M-parameter model 0.95-0.98x and 0.77-0.81x."""


def exact_by_default(pair: ModelPair) -> bool:
    """Whether ``pair``'s engine verifies exactly unless told (:attr:`Frontend.exact_verification`)."""
    return sum(p.numel() for p in pair.large.model.parameters()) >= EXACT_MIN_PARAMETERS


def check_draft_bfloat16(pair: ModelPair, on: Any) -> None:
    """Refuse a ``draft_bfloat16`` that is not a bool or None, or True for a pair whose small model is not a draft
    reading its target's hidden states (:attr:`Frontend.draft_bfloat16`)."""
    if on is None:
        return
    if not isinstance(on, bool):
        raise ValueError(f"draft_bfloat16 must be True or False (or None: where it pays), got {on!r}")
    if on and not reads_features(pair.small.model):
        raise ValueError(
            f"draft_bfloat16 applies to a draft that reads its target's hidden states (ead-llm distill); the small "
            f"model {pair.small.info.source} is an ordinary model: leave draft_bfloat16 unset"
        )


FrontendT = TypeVar("FrontendT", bound="Frontend")


class Frontend:
    """The caller side of an engine: streams, completions, and the queueing of checked sequences."""

    pair: ModelPair
    inputs: InputProcessor
    scheduler: Scheduler
    runners: dict[Role, ModelRunner]
    caches: dict[Role, KVCache]
    max_batch: int
    kv_budget_tokens: int | None
    kv_block_size: int
    _cond: threading.Condition
    load_config: LoadConfig | None

    def __reduce__(self) -> tuple[Any, tuple[LoadConfig]]:
        """Pickled as the pair's load settings; unpickling finds (or loads) the shared engine."""
        if self.load_config is None:
            raise TypeError("this Engine was built from a ModelPair directly; only shared engines can be pickled")
        from ead_llm.core.registry import shared_engine

        return shared_engine, (self.load_config,)

    def __copy__(self: FrontendT) -> FrontendT:
        return self

    def __deepcopy__(self: FrontendT, memo: dict[int, Any]) -> FrontendT:
        """The engine is a shared resource: copying an object that holds it never clones the weights."""
        return self

    def _ensure_thread(self) -> None:
        """Start the thread that runs the steps, if none runs (call with the lock held)."""
        raise NotImplementedError

    def _caches(self) -> dict[Role, KVCache]:
        """Each model's KV cache, built for the current limits."""
        return {
            role: KVCache(
                int(self.pair.model(role).model.config.num_hidden_layers),
                block_size=self.kv_block_size,
                max_tokens=self.kv_budget_tokens,
            )
            for role in Role
        }

    # -- settings, and what callers read ---------------------------------------------------------

    @property
    def faults(self) -> dict[str, int]:
        """Passes retried in smaller batches, and requests failed by a fault (not cancelled), so far."""
        return {
            "retried_passes": sum(runner.retried_passes for runner in self.runners.values()),
            "failed_requests": self.scheduler.failed_requests,
        }

    @property
    def load(self) -> dict[str, int]:
        """Sequences running and waiting, and the KV positions held (in blocks, both models)."""
        with self._cond:
            return {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "reserved_kv": self.scheduler.kv_tokens,
            }

    @property
    def prefix_caching(self) -> bool:
        """Whether requests reuse the KV blocks of prompts and answers seen before (automatic prefix caching)."""
        return self.scheduler.prefix_caching

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"prefix_caching must be True or False, got {on!r}")
        with self._cond:
            if self.scheduler.prefix_caching and not on:
                for cache in self.caches.values():
                    cache.drop_prefix_cache()
                    cache.trim()  # an idle cache gives its storage back
            self.scheduler.prefix_caching = on

    @property
    def exact_verification(self) -> bool:
        """Whether a verification's (or catch-up's) tokens each attend as a one-token decode step would
        (:data:`~ead_llm.core.model_runner.AS_DECODE_MAX`): greedy speculative decoding is then LargeOnly to the
        last bit. By default on for a large model of :data:`EXACT_MIN_PARAMETERS` or more (:func:`exact_by_default`).
        It changes only while no request runs (a ``RuntimeError`` otherwise; setting the value it has is no change)."""
        return self.runners[Role.LARGE].exact_verification

    @exact_verification.setter
    def exact_verification(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"exact_verification must be True or False, got {on!r}")
        if on == self.exact_verification:
            return  # another caller's object may ask for the setting the shared engine has, while it serves
        with self._idle("exact_verification"):
            for runner in self.runners.values():
                runner.exact_verification = on

    @contextmanager
    def _idle(self, setting: str, *, waiting: bool = False) -> Iterator[None]:
        """Hold the engine between steps while a setting that a pass reads changes; a ``RuntimeError`` while a request
        runs (its pass may be under way: it would read both values), or with ``waiting`` also while one waits (a
        setting its admission reads)."""
        with self._cond:
            running, queued = len(self.scheduler.running), len(self.scheduler.waiting) if waiting else 0
            if running or queued:
                raise RuntimeError(
                    f"{setting} can only change while no request runs{' or waits' if waiting else ''} ({running} "
                    f"running{f', {queued} waiting' if waiting else ''}): wait for them, or set it when the engine "
                    "is made"
                )
            yield  # the scheduler thread admits nothing while the lock is held

    @property
    def draft_bfloat16(self) -> bool:
        """Whether the small model, a draft that reads its target's hidden states (``ead-llm distill``), runs its
        products in bfloat16: about half their time where they are memory-bound, as a draft's are at a few rows. Its
        tokens are proposals the large model checks, so greedy speculative decoding's text is the same either way;
        which drafts stand may change. On by default where the CPU multiplies bfloat16 in hardware and the draft's
        products weigh 4 MB or more; a CPU whose bfloat16 products would give a row other bits in another batch keeps
        them float32 (a warning says so when asked for, running requests or not). It changes only while no request
        runs (a ``RuntimeError`` otherwise: a pass under way would read both kernels)."""
        return self.runners[Role.SMALL].draft_bfloat16

    @draft_bfloat16.setter
    def draft_bfloat16(self, on: bool) -> None:
        if on is None:
            raise ValueError("draft_bfloat16 must be True or False, got None")
        check_draft_bfloat16(self.pair, on)
        runner = self.runners[Role.SMALL]
        if on == runner.draft_bfloat16:
            return
        if not on or runner.draft_bfloat16_possible():  # (a refusal changes nothing: no need to wait for idle)
            with self._idle("draft_bfloat16"):
                runner.draft_bfloat16 = on
        if on and not runner.draft_bfloat16:
            logger.warning(
                "ead-llm: the draft's products stay as they are: bfloat16 products need a float32 draft on a CPU "
                "whose oneDNN gives a row the same bits in every batch"
            )

    def set_limits(
        self, max_batch: int | None = None, kv_budget_tokens: int | None = None, kv_block_size: int | None = None
    ) -> None:
        """Change the scheduler's limits (``None`` keeps one). Only while nothing runs or waits."""
        if max_batch is not None:
            check_int("max_batch", max_batch, minimum=1)
        if kv_budget_tokens is not None:
            check_int("kv_budget_tokens", kv_budget_tokens, minimum=1)
        if kv_block_size is not None:
            check_int("kv_block_size", kv_block_size, minimum=1)
        unchanged = (
            max_batch in (None, self.max_batch)
            and kv_budget_tokens in (None, self.kv_budget_tokens)
            and kv_block_size in (None, self.kv_block_size)
        )
        if unchanged:
            return
        with self._idle("the engine's limits", waiting=True):
            self.max_batch = max_batch or self.max_batch
            self.kv_budget_tokens = kv_budget_tokens if kv_budget_tokens is not None else self.kv_budget_tokens
            self.kv_block_size = kv_block_size or self.kv_block_size
            self.caches = self._caches()
            for role, runner in self.runners.items():
                runner.cache = self.caches[role]
            self.scheduler.caches = self.caches
            self.scheduler.max_batch = self.max_batch

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (see :meth:`InputProcessor.encode`)."""
        return self.inputs.encode(prompt)

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids a request decodes from (see :meth:`InputProcessor.prompt_ids`)."""
        return self.inputs.prompt_ids(request)

    @property
    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar machinery."""
        return self.inputs.grammars

    # -- requests in, events out ------------------------------------------------------------------

    def _cancel(self, call: Call) -> None:
        with self._cond:
            call.cancelled = True
            self._cond.notify()
        call.put(WAKE)

    def _fail_row(self, call: Call, index: int, exc: BaseException) -> None:
        """Request ``index`` failed on the caller's side (its text): the scheduler drops it at its next step."""
        with self._cond:
            if call.live(index):
                call.failed[index] = exc
            self._cond.notify()

    def stream(
        self, requests: Sequence[Request], timeout_s: float | None = None, *, isolate: bool = False
    ) -> EventStream:
        """Queue ``requests`` and return their events as they come (one per generated token).

        Everything is checked (and prompts encoded) here, before anything is queued: a bad request
        raises now, not when the stream is first read. ``timeout_s`` counts seconds from this call,
        waiting included. A request that fails raises from the stream and cancels the rest; with
        ``isolate`` it is recorded in ``stream.failures`` and the others go on.
        """
        return self._stream(requests, timeout_s, isolate=isolate, whole=False)

    def _stream(
        self, requests: Sequence[Request], timeout_s: float | None, *, isolate: bool, whole: bool
    ) -> EventStream:
        """:meth:`stream`; ``whole``: the caller reads whole completions, so the events come in one hand-over at
        the end (or when the call is cancelled, as a fail-fast request's failure does) rather than every step."""
        call, sequences, processors = self._submit(requests, timeout_s, isolate=isolate, whole=whole)
        return self._open(EventStream(self, call, processors, timeout_s, isolate=isolate), call, sequences)

    def astream(
        self,
        requests: Sequence[Request],
        timeout_s: float | None = None,
        *,
        isolate: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> AsyncEventStream:
        """:meth:`stream` for async callers: the stream is read on ``loop`` (default: the running one) with no
        thread per item, and cancelling the task that awaits it cancels the requests within one step."""
        loop = loop or asyncio.get_running_loop()
        return self._submit_unless_abandoned(_Submission(), requests, timeout_s, loop, isolate=isolate)

    async def asubmit(
        self, requests: Sequence[Request], timeout_s: float | None = None, *, isolate: bool = False, whole: bool = False
    ) -> AsyncEventStream:
        """:meth:`astream` with the checking and encoding (tokenizers, grammars) done in a worker thread, so the
        event loop stays free; a bad request raises here. Cancelled while submitting, the requests are never
        queued, or, if the worker queued them first, cancelled before the cancellation reaches the caller (so
        they are retired at the end of the step running then, never later). ``whole``: as for :meth:`_stream`."""
        loop = asyncio.get_running_loop()
        submission = _Submission()
        work = asyncio.to_thread(
            self._submit_unless_abandoned, submission, requests, timeout_s, loop, isolate=isolate, whole=whole
        )
        try:
            return await asyncio.shield(asyncio.ensure_future(work))
        except asyncio.CancelledError:
            submission.abandon()
            raise

    def _submit_unless_abandoned(
        self,
        submission: _Submission,
        requests: Sequence[Request],
        timeout_s: float | None,
        loop: asyncio.AbstractEventLoop,
        *,
        isolate: bool,
        whole: bool = False,
    ) -> AsyncEventStream:
        """Check and encode ``requests`` (in :meth:`asubmit`'s worker thread, or inline for :meth:`astream`), then
        queue them unless ``submission`` was abandoned meanwhile."""
        call, sequences, processors = self._submit(requests, timeout_s, isolate=isolate, whole=whole)
        inbox = async_inbox(call, loop)
        stream = AsyncEventStream(self, call, processors, timeout_s, isolate=isolate, inbox=inbox)
        with submission.lock:
            if submission.abandoned:
                stream._done = True
                return stream
            submission.stream = stream
            return self._open(stream, call, sequences)

    def _submit(
        self, requests: Sequence[Request], timeout_s: float | None, *, isolate: bool, whole: bool = False
    ) -> tuple[Call, list[Seq], dict[int, OutputProcessor]]:
        """A call for ``requests``, its sequences (checked and encoded, not queued) and the caller-side
        detokenizers."""
        check_requests(requests)
        if timeout_s is not None:
            check_float("timeout_s", timeout_s, minimum=0.0, exclusive_minimum=True)
        call = Call(fail_fast=not isolate, whole=whole)
        sequences = [
            self.inputs.sequence(call, i, r, self.kv_budget_tokens, self.kv_block_size) for i, r in enumerate(requests)
        ]
        processors = {
            seq.index: OutputProcessor(self.pair.tokenizer, seq.tokens, ()) for seq in sequences if seq.output is None
        }
        return call, sequences, processors

    def _open(self, stream: StreamT, call: Call, sequences: list[Seq]) -> StreamT:
        """Queue the call's sequences (the stream is already made, so nothing is missed)."""
        if not sequences:
            stream._done = True
            return stream
        call.open = {seq.index: 1 for seq in sequences}
        with self._cond:
            self.scheduler.waiting.extend(sequences)
            self._ensure_thread()
            self._cond.notify()
        return stream

    # -- the one result type -----------------------------------------------------------------------

    @overload
    def generate(
        self,
        requests: Sequence[Request],
        pricing: Pricing | None = None,
        timeout_s: float | None = None,
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[Completion]: ...

    @overload
    def generate(
        self,
        requests: Sequence[Request],
        pricing: Pricing | None = None,
        timeout_s: float | None = None,
        *,
        return_exceptions: Literal[True],
    ) -> list[Completion | BaseException]: ...

    def generate(
        self,
        requests: Sequence[Request],
        pricing: Pricing | None = None,
        timeout_s: float | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[Completion] | list[Completion | BaseException]:
        """Run requests to completion and return one :class:`Completion` per request, in order.

        A request that fails raises (the others are cancelled); with ``return_exceptions`` its error takes
        its place in the list and the others finish as they would alone. With ``timeout_s``, a call still
        running after that many seconds raises ``TimeoutError``; its sequences' caches are freed.
        """
        builder = CompletionBuilder(requests, (self.pair.small.info, self.pair.large.info), pricing)
        stream = self._stream(requests, timeout_s, isolate=return_exceptions, whole=True)
        try:
            for event in stream:
                builder.record(event)
        finally:
            stream.close()
        return builder.results(stream.failures)

    @overload
    async def agenerate(
        self,
        requests: Sequence[Request],
        pricing: Pricing | None = None,
        timeout_s: float | None = None,
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[Completion]: ...

    @overload
    async def agenerate(
        self,
        requests: Sequence[Request],
        pricing: Pricing | None = None,
        timeout_s: float | None = None,
        *,
        return_exceptions: Literal[True],
    ) -> list[Completion | BaseException]: ...

    async def agenerate(
        self,
        requests: Sequence[Request],
        pricing: Pricing | None = None,
        timeout_s: float | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[Completion] | list[Completion | BaseException]:
        """:meth:`generate` for async callers: cancelling the awaiting task (``asyncio.wait_for``, a client that
        left) stops the requests within one engine step and frees their caches."""
        builder = CompletionBuilder(requests, (self.pair.small.info, self.pair.large.info), pricing)
        stream = await self.asubmit(requests, timeout_s, isolate=return_exceptions, whole=True)
        try:
            async for event in stream:
                builder.record(event)
        finally:
            stream.close()
        return builder.results(stream.failures)


class _Submission:
    """An async submission's hand-over between the worker that queues it and the caller that may leave first:
    under ``lock``, either the worker sees ``abandoned`` and queues nothing, or the caller finds ``stream``
    (queued) and cancels it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.stream: AsyncEventStream | None = None

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True
            if self.stream is not None:
                self.stream.close()
