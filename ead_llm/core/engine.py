"""The engine: one loaded pair shared by every caller, decoding step by step under each request's policy.

A scheduler thread runs the step loop for all callers at once. One step::

    passes = scheduler.schedule()                # per model: which rows run, what each reads
    for role, rows in passes:                    # one packed pass per model
        out = runners[role].execute(rows)        # logits only at the positions read: [N, V]
        results = sample(out)                    # sampler + rejection sampler, one host sync
        for seq, result in results:
            scheduler.apply(seq, seq.decoder.on_...(seq, result))   # Emit / Draft / Rollback / Fork
    publish(scheduler.finish_step())             # retire, then events to their callers

Callers get one :class:`TokenEvent` per emitted token through an :class:`EventStream`; text,
stop strings, the ledger and the framework adapters all consume that one stream.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import torch

from ead_llm.accounting.ledger import Pricing
from ead_llm.core.grammar import GrammarCompiler, apply_bitmask
from ead_llm.core.kv_cache import DEFAULT_BLOCK_SIZE, KVCache, SequenceKV
from ead_llm.core.loading import LoadConfig, ModelPair
from ead_llm.core.model_runner import ModelRunner, PassRow, RunnerOutput
from ead_llm.core.ops import entropy_bits, top_k_entropy_nats, top_two
from ead_llm.core.output import OutputProcessor
from ead_llm.core.rejection_sampler import VerifyBatch, verify
from ead_llm.core.request import Completion, Prompt, PromptTooLongError, Request, sequence_key
from ead_llm.core.sampler import Sampler, SamplingMetadata, stream_key
from ead_llm.core.scheduler import DONE, WAKE, Call, Scheduler
from ead_llm.core.scheduler import Sequence as Seq
from ead_llm.core.streams import AsyncEventStream, CompletionBuilder, EventStream, async_inbox
from ead_llm.core.types import DraftRound, ForwardWork, Read, Role, RoundVerdict, TokenSample
from ead_llm.core.validation import check_float, check_int

logger = logging.getLogger(__name__)
StreamT = TypeVar("StreamT", EventStream, AsyncEventStream)
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    for engine in list(_ENGINES):
        engine.close()


def _check_requests(requests: Sequence[Request]) -> None:
    if isinstance(requests, (str, Request)):
        raise ValueError("requests must be a list of Request objects")
    for request in requests:
        if not isinstance(request, Request):
            raise ValueError(f"requests must be Request objects, got {request!r}")


def warn_unknown_characters(tokenizer: Any, prompt: str) -> None:
    """Warn that ``prompt`` has characters the vocabulary lacks (each reads as the unknown token), naming
    them, and the vocabulary itself when it is small (the embedded pair's 20 tokens)."""
    unk = tokenizer.unk_token_id
    missing = sorted({c for c in prompt if unk in tokenizer.encode(c, add_special_tokens=False)})
    vocab = tokenizer.get_vocab()
    known = ""
    if len(vocab) <= 64:
        chars = sorted(t for t in vocab if len(t) == 1)
        known = (
            f"; this vocabulary has only {''.join(chars)!r} (the embedded pair's prompts look like '4821+3907-1568\\n')"
        )
    warnings.warn(
        f"prompt characters outside the vocabulary, read as {tokenizer.unk_token!r}: {missing}{known}",
        UserWarning,
        stacklevel=4,
    )


class Engine:
    """Decodes requests on a loaded pair for any number of callers (threads or async tasks).

    Callers' requests queue and join the running batch (continuous batching). At most ``max_batch``
    sequences run at once; each model's KV cache is paged in blocks of ``kv_block_size`` positions
    and holds at most ``kv_budget_tokens`` positions (None: grows as needed), so memory follows the
    tokens actually held. A sequence's randomness is its own (its seed, stream and position), so its
    text does not depend on what else runs; in float32 greedy text does not either. In bfloat16,
    passes of different shapes (a batch, a verification) round differently and near-ties can flip
    (see the README's figures).
    """

    def __init__(
        self,
        pair: ModelPair,
        max_batch: int = 64,
        kv_budget_tokens: int | None = None,
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        self.pair = pair
        self.tokenizer = pair.tokenizer
        limits = [m.info.max_positions for m in (pair.small, pair.large) if m.info.max_positions]
        self.max_positions: int | None = min(limits) if limits else None
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        if kv_budget_tokens is not None:
            check_int("kv_budget_tokens", kv_budget_tokens, minimum=1)
        self.kv_budget_tokens = kv_budget_tokens
        self.kv_block_size = check_int("kv_block_size", kv_block_size, minimum=1)
        self.caches = self._caches()
        self.runners = {
            role: ModelRunner(pair.model(role), pair.device, pair.vocab_size, self.caches[role]) for role in Role
        }
        self.sampler = Sampler()
        self.scheduler = Scheduler(self.caches, self.max_batch, self.max_positions)
        self._grammars: GrammarCompiler | None = None
        self.entropy_after_mask = True
        """Constrained rows report (and EAD decides on) the entropy of their masked logits; False: of the
        raw logits (measured against the default in ``benchmarks/constrained.py``)."""
        self.load_config: LoadConfig | None = None
        """Set by the registry: how to load this pair again (pickling an object that holds the engine
        stores this instead of the weights)."""
        self.steps = 0
        """Engine steps run so far (a cancelled request is retired at the end of the step running when it was
        cancelled, so it costs at most one more)."""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        _ENGINES.add(self)

    def _caches(self) -> dict[Role, KVCache]:
        return {
            role: KVCache(
                int(self.pair.model(role).model.config.num_hidden_layers),
                block_size=self.kv_block_size,
                max_tokens=self.kv_budget_tokens,
            )
            for role in Role
        }

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

    @property
    def faults(self) -> dict[str, int]:
        """Passes retried in smaller batches, and requests failed by a fault (not cancelled), so far."""
        return {
            "retried_passes": sum(runner.retried_passes for runner in self.runners.values()),
            "failed_requests": self.scheduler.failed_requests,
        }

    # -- prompts ---------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (special tokens as the tokenizer adds them; BOS for an empty prompt)."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
            unk = self.tokenizer.unk_token_id
            if unk is not None and unk in ids:
                warn_unknown_characters(self.tokenizer, prompt)
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
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the models accept at most {limit} positions in all: "
                "shorten the prompt, or pass prompt_truncation='left' to drop its oldest tokens"
            )
        keep = max(1, limit - request.sampling.max_tokens)
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[0] == bos and keep > 1:
            return [ids[0], *ids[len(ids) - keep + 1 :]]
        return ids[len(ids) - keep :]

    @property
    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar machinery (built on the first constrained request)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.pair.vocab_size, self.pair.eos_token_ids)
        return self._grammars

    # -- callers ---------------------------------------------------------------------------------

    def _sequence(self, call: Call, index: int, request: Request) -> Seq:
        ids = self.prompt_ids(request)
        max_length = len(ids) + request.sampling.max_tokens
        if self.max_positions is not None:
            max_length = min(max_length, self.max_positions)
        budget = self.kv_budget_tokens
        if budget is not None and -(-max_length // self.kv_block_size) * self.kv_block_size > budget:
            raise ValueError(
                f"a request needs up to {max_length} KV positions (prompt {len(ids)} + max_tokens "
                f"{request.sampling.max_tokens}, in blocks of {self.kv_block_size}) but kv_budget_tokens is "
                f"{budget}: lower max_tokens or raise the budget"
            )
        params = request.policy.sampling(request.sampling)
        stream = request.sample_index or 0  # the request's own stream, never its place in the call
        decoder = request.policy.build_decoder(sequence_key(ids, stream), call.shared)
        text_here = bool(params.stop) or decoder.forks
        return Seq(
            call=call,
            index=index,
            tokens=ids,
            prompt_len=len(ids),
            params=params,
            decoder=decoder,
            key=stream_key(params.seed, stream),
            kv={role: SequenceKV() for role in Role},
            max_length=max_length,
            eos=self.pair.eos_token_ids,
            output=OutputProcessor(self.tokenizer, ids, params.stop) if text_here else None,
            grammar=None if params.constraint is None else self.grammars.start(params.constraint, len(ids)),
        )

    def stream(
        self, requests: Sequence[Request], timeout_s: float | None = None, *, isolate: bool = False
    ) -> EventStream:
        """Queue ``requests`` and return their events as they come (one per generated token).

        Everything is checked (and prompts encoded) here, before anything is queued: a bad request
        raises now, not when the stream is first read. ``timeout_s`` counts seconds from this call,
        waiting included. A request that fails raises from the stream and cancels the rest; with
        ``isolate`` it is recorded in ``stream.failures`` and the others go on.
        """
        call, sequences, processors = self._submit(requests, timeout_s, isolate=isolate)
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
        call, sequences, processors = self._submit(requests, timeout_s, isolate=isolate)
        inbox = async_inbox(call, loop or asyncio.get_running_loop())
        stream = AsyncEventStream(self, call, processors, timeout_s, isolate=isolate, inbox=inbox)
        return self._open(stream, call, sequences)

    async def asubmit(
        self, requests: Sequence[Request], timeout_s: float | None = None, *, isolate: bool = False
    ) -> AsyncEventStream:
        """:meth:`astream` with the checking and encoding (tokenizers, grammars) done in a worker thread, so the
        event loop stays free; a bad request raises here. Cancelled while submitting, the requests are cancelled
        as soon as they are queued (they are retired at the end of the step running then)."""
        loop = asyncio.get_running_loop()
        work = asyncio.ensure_future(asyncio.to_thread(self.astream, requests, timeout_s, isolate=isolate, loop=loop))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_close_submitted)  # queued after all: cancel it as soon as it is
            raise

    def _submit(
        self, requests: Sequence[Request], timeout_s: float | None, *, isolate: bool
    ) -> tuple[Call, list[Seq], dict[int, OutputProcessor]]:
        """A call for ``requests``, its sequences (checked and encoded, not queued) and the caller-side
        detokenizers."""
        _check_requests(requests)
        if timeout_s is not None:
            check_float("timeout_s", timeout_s, minimum=0.0, exclusive_minimum=True)
        call = Call(fail_fast=not isolate)
        sequences = [self._sequence(call, i, r) for i, r in enumerate(requests)]
        processors = {
            seq.index: OutputProcessor(self.tokenizer, seq.tokens, ()) for seq in sequences if seq.output is None
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

    def _ensure_thread(self) -> None:
        """Start the scheduler thread if none runs (call with the lock held); a thread still stopping
        from ``close()`` is waited for first, so that two never run passes on the same models."""
        thread = self._thread
        if thread is not None and thread.is_alive() and not self._stop.is_set():
            return
        if thread is not None and thread.is_alive():
            self._cond.release()
            try:
                thread.join()
            finally:
                self._cond.acquire()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="ead-llm-engine", daemon=True)
        self._thread.start()

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
        with self._cond:
            new = (
                max_batch in (None, self.max_batch)
                and kv_budget_tokens in (None, self.kv_budget_tokens)
                and kv_block_size in (None, self.kv_block_size)
            )
            if new:
                return
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("the engine's limits can only change while it is idle")
            self.max_batch = max_batch or self.max_batch
            self.kv_budget_tokens = kv_budget_tokens if kv_budget_tokens is not None else self.kv_budget_tokens
            self.kv_block_size = kv_block_size or self.kv_block_size
            self.caches = self._caches()
            for role, runner in self.runners.items():
                runner.cache = self.caches[role]
            self.scheduler.caches = self.caches
            self.scheduler.max_batch = self.max_batch

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the scheduler thread (failing whatever runs or waits); called at interpreter exit.

        Returns whether it stopped within ``timeout_s``. One still inside a pass stops after it, and
        the next call waits for that before starting a new thread. Stopping it at exit, rather than
        leaving a daemon thread inside torch while the interpreter tears down, avoids an abort.
        """
        with self._cond:
            thread = self._thread
            self._stop.set()
            self._abort(RuntimeError("the engine was closed"))
            self._cond.notify_all()
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            logger.warning("the ead-llm scheduler thread is still in a pass; it stops after it")
            return False
        return True

    @property
    def load(self) -> dict[str, int]:
        """Sequences running and waiting, and the KV positions held (in blocks, both models)."""
        with self._cond:
            return {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "reserved_kv": self.scheduler.kv_tokens,
            }

    # -- the scheduler thread --------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        with torch.inference_mode():
            while True:
                try:
                    if not self._serve_once(stop):
                        return
                except Exception as exc:  # admission or retirement broke: fail what runs or waits, serve on
                    logger.exception("ead-llm scheduler fault; failing the requests in flight")
                    with self._cond:
                        self._abort(exc)

    def _serve_once(self, stop: threading.Event) -> bool:
        """Wait for work, run one step, deliver its items; False once the engine is stopping."""
        scheduler = self.scheduler
        with self._cond:
            while True:
                scheduler.drop_cancelled()
                if stop.is_set():
                    return False
                scheduler.admit()
                if scheduler.running or scheduler.has_deliveries:
                    break
                self._cond.wait()
        if scheduler.running:
            try:
                self._step()
            except Exception as exc:  # a fault outside any row: fail what runs, keep serving
                logger.exception("ead-llm engine step failed")
                for seq in list(scheduler.running):
                    scheduler.fail(seq, exc)
            self.steps += 1
        with self._cond:
            deliveries = scheduler.finish_step()
        for call, items in deliveries.items():
            call.put(items)  # one hand-over per caller per step
        return True

    def _abort(self, exc: BaseException) -> None:
        """Fail every running and waiting request with ``exc``, tell their callers, and start the caches
        afresh (call with the lock held). Used when the engine closes or its own bookkeeping broke."""
        scheduler = self.scheduler
        calls = {seq.call: None for seq in [*scheduler.running, *scheduler.waiting]}
        scheduler.fail_all(exc)
        outbox = scheduler.take_outbox()
        scheduler.running, scheduler.waiting = [], collections.deque()
        for cache in self.caches.values():
            cache.clear()
        for call, item in outbox:
            call.put([item])
        for call in calls:
            if not call.closed:
                call.closed = True
                call.put([DONE])

    def _step(self) -> None:
        for role, rows in self.scheduler.schedule():
            self._pass(role, rows)

    def _pass(self, role: Role, rows: list[tuple[Seq, Read]]) -> None:
        """One model's pass over its rows: run, sample and verify, then each decoder's actions."""
        out = self.runners[role].execute([PassRow(seq.kv[role], seq.tokens, read.positions) for seq, read in rows])
        for i, exc in out.failures.items():
            self.scheduler.fail(rows[i][0], exc)
        ok = [i for i in range(len(rows)) if i in out.work]
        for i in ok:
            rows[i][0].pending_work.append(out.work[i])
        sampled = [i for i in ok if not rows[i][1].verify]
        verified = [i for i in ok if rows[i][1].verify]
        pending = _Pending()
        if sampled:
            self._sample(role, [rows[i][0] for i in sampled], out, sampled, pending)
        if verified:
            self._verify([rows[i][0] for i in verified], out, verified, pending)
        # decoders act in a fixed order (rows that caught up on several tokens, then decodes, then
        # verifications): where paths of one call compete for a budget (EAGER), the order decides
        results = sorted(pending.to_host(), key=lambda item: (_rank(out.work[item[0]], rows[item[0]][1]), item[0]))
        room = self.scheduler.fork_room()
        for i, result in results:
            seq = rows[i][0]
            if seq.finished:
                continue
            try:
                if isinstance(result, RoundVerdict):
                    actions = seq.decoder.on_verdict(seq, result)
                else:
                    actions = seq.decoder.on_token(seq, result, room)
                self.scheduler.apply(seq, actions)
            except Exception as exc:  # this request fails; everyone else carries on
                self.scheduler.fail(seq, exc)

    def _per_row(self, seqs: list[Seq], run: Callable[[list[int]], None]) -> None:
        """``run`` a batched stage over every row of ``seqs`` (it records its results only once it succeeds);
        if it raises, over each row alone, so that a row that still fails fails its own request only."""
        try:
            run(list(range(len(seqs))))
        except Exception:
            if len(seqs) == 1:
                raise
            for b in range(len(seqs)):
                try:
                    run([b])
                except Exception as exc:
                    self.scheduler.fail(seqs[b], exc)

    def _sample(self, role: Role, seqs: list[Seq], out: RunnerOutput, rows: list[int], pending: _Pending) -> None:
        logits = out.last_rows(rows)  # [B, V]
        raw = entropy_bits(logits) if not self.entropy_after_mask and any(s.grammar for s in seqs) else None
        self._constrain(logits, seqs)

        def run(part: list[int]) -> None:
            whole = len(part) == len(seqs)
            chosen = [seqs[b] for b in part]
            rows_logits = logits if whole else logits[part]  # [b, V]
            meta = SamplingMetadata.build(
                [(q.params.temperature, q.params.top_k, q.params.top_p, q.key, len(q.tokens)) for q in chosen],
                logits.device,
            )
            sampled = self.sampler(rows_logits, meta)
            entropy = sampled.entropy_bits if raw is None else raw if whole else raw[part]
            columns = [sampled.tokens, entropy]
            branching = any(q.decoder.branch_stats for q in chosen)
            if branching:
                columns += [*top_two(rows_logits), self._branch_entropy(rows_logits, chosen)]

            def finish(host: list[list[float]]) -> list[tuple[int, TokenSample]]:
                tokens, entropies = host[0], host[1]
                extra = host[2:] if branching else None
                return [
                    (
                        rows[b],
                        TokenSample(
                            role=role,
                            token=int(tokens[j]),
                            entropy=entropies[j],
                            logits=logits[b],
                            top2=(int(extra[0][j]), int(extra[1][j])) if extra is not None else None,
                            top_k_nats=extra[2][j] if extra is not None else None,
                        ),
                    )
                    for j, b in enumerate(part)
                ]

            pending.add(columns, finish)

        self._per_row(seqs, run)

    def _masks(self, seqs: list[Seq]) -> torch.Tensor:
        """``[N, W]`` bitmasks of the next token of ``seqs`` (all constrained); a row whose grammar fails fails its
        request (its row of the mask allows everything: nothing reads it)."""
        grammars = [seq.grammar for seq in seqs]
        assert all(g is not None for g in grammars)
        bitmask, failures = self.grammars.masks(grammars)  # type: ignore[arg-type]
        for j, exc in failures.items():
            self.scheduler.fail(seqs[j], exc)
        return bitmask

    def _constrain(self, logits: torch.Tensor, seqs: list[Seq]) -> None:
        """Constrained rows of ``logits`` ``[N, V]`` lose the tokens their grammar forbids (in place), before
        anything reads them: sampling, entropy (so EAD sees the uncertainty among allowed tokens) and drafts."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return
        bitmask = self._masks([seqs[i] for i in rows])
        if len(rows) == len(seqs):
            apply_bitmask(logits, bitmask)
        else:
            index = torch.tensor(rows, device=logits.device)
            part = logits.index_select(0, index)
            apply_bitmask(part, bitmask)
            logits.index_copy_(0, index, part)

    @staticmethod
    def _branch_entropy(logits: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
        """EAGER's entropy (nats over each row's top-k, as its decoder asks; rows that do not branch get 20)."""
        ks = [seq.decoder.branch_top_k for seq in seqs]
        if len(set(ks)) == 1:
            return top_k_entropy_nats(logits, ks[0])
        out = torch.empty(len(seqs), device=logits.device)
        for k in set(ks):
            index = torch.tensor([b for b, v in enumerate(ks) if v == k], device=logits.device)
            out[index] = top_k_entropy_nats(logits[index], k)
        return out

    def _verify(self, seqs: list[Seq], out: RunnerOutput, rows: list[int], pending: _Pending) -> None:
        rounds: dict[int, DraftRound] = {}
        for b, seq in enumerate(seqs):
            try:
                rounds[b] = seq.decoder.draft_round(seq)
            except Exception as exc:  # a broken round fails its own request
                self.scheduler.fail(seq, exc)
        live = [b for b in range(len(seqs)) if b in rounds]
        if not live:
            return
        seqs, rows, judged = [seqs[b] for b in live], [rows[b] for b in live], [rounds[b] for b in live]
        gamma = max(len(r.tokens) for r in judged)
        target = out.padded_rows(rows, gamma + 1)  # [R, G+1, V]
        self._constrain_rounds(target, seqs, judged)

        def run(part: list[int]) -> None:
            verdict = verify(
                self._verify_batch([seqs[b] for b in part], [judged[b] for b in part], target[part], gamma)
            )

            def finish(host: list[list[float]]) -> list[tuple[int, RoundVerdict]]:
                accepted, token, rejected, entropy = host
                width = gamma + 1
                return [
                    (
                        rows[b],
                        RoundVerdict(
                            accepted=int(accepted[j]),
                            token=None if token[j] < 0 else int(token[j]),
                            entropy_rejection=bool(rejected[j]),
                            target_entropy=tuple(entropy[j * width : (j + 1) * width]),
                        ),
                    )
                    for j, b in enumerate(part)
                ]

            pending.add([verdict.accepted, verdict.token, verdict.entropy_rejection, verdict.target_entropy], finish)

        self._per_row(seqs, run)

    @staticmethod
    def _verify_batch(seqs: list[Seq], rounds: list[DraftRound], target: torch.Tensor, gamma: int) -> VerifyBatch:
        """The rejection sampler's input for ``rounds`` (padded to ``gamma`` drafts), ``target`` ``[R, G+1, V]``."""
        vocab, device = target.shape[-1], target.device
        filler = torch.zeros(vocab, device=device)
        draft_logits = (
            torch.stack([torch.stack([*r.logits, *[filler] * (gamma - len(r.tokens))]) for r in rounds])
            if gamma
            else torch.zeros((len(rounds), 0, vocab), device=device)
        )
        sampled = [seq.params.temperature > 0 for seq in seqs]

        def column(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return VerifyBatch(
            draft_tokens=column([[*r.tokens, *[0] * (gamma - len(r.tokens))] for r in rounds], torch.long).reshape(
                len(rounds), gamma
            ),
            num_drafts=column([len(r.tokens) for r in rounds], torch.long),
            draft_logits=draft_logits,
            draft_entropy=column(
                [[*r.entropies, *[0.0] * (gamma - len(r.tokens))] for r in rounds], torch.float32
            ).reshape(len(rounds), gamma),
            target_logits=target,
            temperature=column([seq.params.temperature for seq in seqs], torch.float32),
            top_k=column([seq.params.top_k for seq in seqs], torch.long),
            top_p=column([seq.params.top_p for seq in seqs], torch.float32),
            keys=column([seq.key for seq in seqs], torch.long),
            positions=column([r.first_position for r in rounds], torch.long),
            entropy_threshold=column([r.entropy_threshold for r in rounds], torch.float32),
            top_n=column([r.top_n for r in rounds], torch.long),
            overlap_threshold=column([r.overlap_threshold for r in rounds], torch.float32),
            oracle=column([r.oracle for r in rounds], torch.bool),
            max_top_k=max((seq.params.top_k for seq, s in zip(seqs, sampled, strict=True) if s), default=0),
            any_top_p=any(seq.params.top_p < 1.0 for seq, s in zip(seqs, sampled, strict=True) if s),
            max_top_n=max((r.top_n for r in rounds if r.entropy_threshold != float("inf")), default=1),
            any_sampled=any(sampled),
            any_entropy_rule=any(r.entropy_threshold != float("inf") for r in rounds),
        )

    def _constrain_rounds(self, target: torch.Tensor, seqs: list[Seq], rounds: list[DraftRound]) -> None:
        """The large model's logits ``[R, G+1, V]`` of constrained rounds under the masks their drafts were
        drawn under (kept per position), and, after the drafts, the grammar's mask where it stands now. A round
        whose kept masks are missing fails its request."""
        constrained = [b for b, seq in enumerate(seqs) if seq.grammar is not None]
        if not constrained:
            return
        width = target.shape[1]
        now = self._masks([seqs[b] for b in constrained])
        words = now.shape[1]
        bitmask = torch.full((len(constrained), width, words), -1, dtype=torch.int32)
        for j, b in enumerate(constrained):
            grammar, first, drafts = seqs[b].grammar, rounds[b].first_position, len(rounds[b].tokens)
            assert grammar is not None
            kept = [grammar.mask_at(first + d) for d in range(drafts)]
            if any(mask is None for mask in kept):
                self.scheduler.fail(seqs[b], RuntimeError(f"no grammar mask kept for a draft after position {first}"))
                continue
            if kept:
                bitmask[j, :drafts] = torch.stack(kept)  # type: ignore[arg-type]
            bitmask[j, drafts:] = now[j]
        index = torch.tensor(constrained, device=target.device)
        part = target.index_select(0, index)
        apply_bitmask(part.view(-1, target.shape[-1]), bitmask.view(-1, words))
        target.index_copy_(0, index, part)

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
        stream = self.stream(requests, timeout_s, isolate=return_exceptions)
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
        stream = await self.asubmit(requests, timeout_s, isolate=return_exceptions)
        try:
            async for event in stream:
                builder.record(event)
        finally:
            stream.close()
        return builder.results(stream.failures)


def _close_submitted(work: asyncio.Future[AsyncEventStream]) -> None:
    if not work.cancelled() and work.exception() is None:
        work.result().close()


def _rank(work: ForwardWork, read: Read) -> int:
    return 2 if read.verify else 0 if work.tokens > 1 else 1


class _Pending:
    """Device results of one pass, brought to the host in one transfer, then turned into results."""

    def __init__(self) -> None:
        self._columns: list[torch.Tensor] = []
        self._parts: list[tuple[int, Any]] = []

    def add(self, columns: list[torch.Tensor], finish: Any) -> None:
        self._parts.append((len(columns), finish))
        self._columns.extend(columns)

    def to_host(self) -> list[tuple[int, Any]]:
        if not self._columns:
            return []
        flat = torch.cat([c.reshape(-1).to(torch.float64) for c in self._columns]).tolist()  # the one sync
        host, at = [], 0
        for column in self._columns:
            host.append(flat[at : at + column.numel()])
            at += column.numel()
        results, first = [], 0
        for count, finish in self._parts:
            results.extend(finish(host[first : first + count]))
            first += count
        return sorted(results, key=lambda item: item[0])
