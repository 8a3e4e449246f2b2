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

import atexit
import collections
import logging
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ead_llm.accounting.ledger import CompletionLedger, Cost, Pricing
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
from ead_llm.core.types import ForwardWork, Role, TokenEvent
from ead_llm.core.validation import check_float, check_int
from ead_llm.policies.base import Read, RoundVerdict, TokenSample

logger = logging.getLogger(__name__)
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


def _with_text(event: TokenEvent, text: str) -> TokenEvent:
    """``event`` with its text filled in (``dataclasses.replace`` without its per-field overhead)."""
    filled = object.__new__(TokenEvent)
    filled.__dict__.update(event.__dict__, text=text)
    return filled


class EventStream(Iterator[TokenEvent]):
    """A call's events, interleaved across its requests and paths, as the scheduler produces them.

    Detokenizes on the caller's thread the sequences the scheduler did not (those without stop
    strings or branches). ``close()`` (or leaving a ``for`` loop early) cancels what is left and
    frees its caches; ``cancel()`` does so from any thread, waking a reader blocked on the stream.
    Past ``timeout_s`` it raises ``TimeoutError`` and cancels.
    """

    def __init__(
        self,
        engine: Engine,
        call: Call,
        processors: dict[int, OutputProcessor],
        timeout_s: float | None,
    ) -> None:
        self._engine, self._call, self._processors = engine, call, processors
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._done = False
        self._buffer: collections.deque[Any] = collections.deque()

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> TokenEvent:
        if self._done:
            raise StopIteration
        while not self._buffer:
            try:
                wait = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                items = self._call.queue.get(timeout=wait)
            except queue.Empty:
                self.cancel()
                raise TimeoutError(
                    f"the call took longer than {self._timeout_s} s: raise the timeout or lower max_tokens"
                ) from None
            self._buffer.extend(items if isinstance(items, list) else [items])
        item = self._buffer.popleft()
        if item is DONE or item is WAKE:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        processor = self._processors.get(item.index)
        if processor is not None:
            item = _with_text(item, processor.push(item.token_id, last=item.finish_reason is not None))
        return item

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
        stream = index if request.sample_index is None else request.sample_index
        decoder = request.policy.build_decoder(sequence_key(ids, request.sample_index or 0), call.shared)
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

    def stream(self, requests: Sequence[Request], timeout_s: float | None = None) -> EventStream:
        """Queue ``requests`` and return their events as they come (one per generated token).

        Everything is checked (and prompts encoded) here, before anything is queued: a bad request
        raises now, not when the stream is first read. ``timeout_s`` counts seconds from this call,
        waiting included.
        """
        _check_requests(requests)
        if timeout_s is not None:
            check_float("timeout_s", timeout_s, minimum=0.0, exclusive_minimum=True)
        call = Call()
        sequences = [self._sequence(call, i, r) for i, r in enumerate(requests)]
        processors = {
            seq.index: OutputProcessor(self.tokenizer, seq.tokens, ()) for seq in sequences if seq.output is None
        }
        stream = EventStream(self, call, processors, timeout_s)
        if not sequences:
            stream._done = True
            return stream
        call.open = len(sequences)
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
        call.queue.put(WAKE)

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
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                if not seq.call.failed:
                    seq.call.failed = True
                    seq.call.queue.put(RuntimeError("the engine was closed"))
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
        scheduler = self.scheduler
        with torch.inference_mode():
            while True:
                with self._cond:
                    while True:
                        if stop.is_set():
                            scheduler.drop_cancelled()
                            return
                        scheduler.drop_cancelled()
                        scheduler.admit()
                        if scheduler.running:
                            break
                        self._cond.wait()
                try:
                    self._step()
                except Exception as exc:  # an engine fault: fail what runs, keep serving
                    logger.exception("ead-llm engine step failed")
                    for seq in list(scheduler.running):
                        scheduler.fail(seq, exc)
                with self._cond:
                    deliveries = scheduler.finish_step()
                for call, items in deliveries.items():
                    call.queue.put(items)  # one hand-over per caller per step

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

    def _sample(self, role: Role, seqs: list[Seq], out: RunnerOutput, rows: list[int], pending: _Pending) -> None:
        logits = out.last_rows(rows)  # [B, V]
        grammars = [seq.grammar for seq in seqs]
        raw = entropy_bits(logits) if not self.entropy_after_mask and any(grammars) else None
        self._constrain(logits, grammars)
        meta = SamplingMetadata.build(
            [(seq.params.temperature, seq.params.top_k, seq.params.top_p, seq.key, len(seq.tokens)) for seq in seqs],
            logits.device,
        )
        sampled = self.sampler(logits, meta)
        columns = [sampled.tokens, sampled.entropy_bits if raw is None else raw]
        stats = [seq.decoder.branch_stats for seq in seqs]
        branching = any(stats)
        if branching:
            columns += [*top_two(logits), self._branch_entropy(logits, seqs)]

        def finish(host: list[list[float]]) -> list[tuple[int, TokenSample]]:
            tokens, entropy = host[0], host[1]
            extra = host[2:] if branching else None
            results = []
            for b, i in enumerate(rows):
                sample = TokenSample(
                    role=role,
                    token=int(tokens[b]),
                    entropy=entropy[b],
                    logits=logits[b],
                    top2=(int(extra[0][b]), int(extra[1][b])) if extra is not None else None,
                    top_k_nats=extra[2][b] if extra is not None else None,
                )
                results.append((i, sample))
            return results

        pending.add(columns, finish)

    def _constrain(self, logits: torch.Tensor, grammars: list[Any]) -> None:
        """Constrained rows of ``logits`` ``[N, V]`` lose the tokens their grammar forbids (in place), before
        anything reads them: sampling, entropy (so EAD sees the uncertainty among allowed tokens) and drafts."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        bitmask = self.grammars.masks([grammars[i] for i in rows])
        if len(rows) == len(grammars):
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
        rounds = [seq.decoder.draft_round(seq) for seq in seqs]
        gamma = max(len(r.tokens) for r in rounds)
        target = out.padded_rows(rows, gamma + 1)  # [R, G+1, V]
        self._constrain_rounds(target, seqs, rounds)
        vocab = target.shape[-1]
        device = target.device
        filler = torch.zeros(vocab, device=device)
        draft_logits = (
            torch.stack(
                [torch.stack([*r.logits, *[filler] * (gamma - len(r.tokens))]) if gamma else filler[:0] for r in rounds]
            )
            if gamma
            else torch.zeros((len(rounds), 0, vocab), device=device)
        )
        sampled = [seq.params.temperature > 0 for seq in seqs]
        batch = VerifyBatch(
            draft_tokens=torch.tensor([[*r.tokens, *[0] * (gamma - len(r.tokens))] for r in rounds], device=device)
            .long()
            .reshape(len(rounds), gamma),
            num_drafts=torch.tensor([len(r.tokens) for r in rounds], dtype=torch.long, device=device),
            draft_logits=draft_logits,
            draft_entropy=torch.tensor(
                [[*r.entropies, *[0.0] * (gamma - len(r.tokens))] for r in rounds], dtype=torch.float32, device=device
            ).reshape(len(rounds), gamma),
            target_logits=target,
            temperature=torch.tensor([seq.params.temperature for seq in seqs], dtype=torch.float32, device=device),
            top_k=torch.tensor([seq.params.top_k for seq in seqs], dtype=torch.long, device=device),
            top_p=torch.tensor([seq.params.top_p for seq in seqs], dtype=torch.float32, device=device),
            keys=torch.tensor([seq.key for seq in seqs], dtype=torch.long, device=device),
            positions=torch.tensor([r.first_position for r in rounds], dtype=torch.long, device=device),
            entropy_threshold=torch.tensor([r.entropy_threshold for r in rounds], dtype=torch.float32, device=device),
            top_n=torch.tensor([r.top_n for r in rounds], dtype=torch.long, device=device),
            overlap_threshold=torch.tensor([r.overlap_threshold for r in rounds], dtype=torch.float32, device=device),
            oracle=torch.tensor([r.oracle for r in rounds], dtype=torch.bool, device=device),
            max_top_k=max((seq.params.top_k for seq, s in zip(seqs, sampled, strict=True) if s), default=0),
            any_top_p=any(seq.params.top_p < 1.0 for seq, s in zip(seqs, sampled, strict=True) if s),
            max_top_n=max((r.top_n for r in rounds if r.entropy_threshold != float("inf")), default=1),
            any_sampled=any(sampled),
            any_entropy_rule=any(r.entropy_threshold != float("inf") for r in rounds),
        )
        verdict = verify(batch)

        def finish(host: list[list[float]]) -> list[tuple[int, RoundVerdict]]:
            accepted, token, rejected, entropy = host
            results = []
            for b, i in enumerate(rows):
                width = gamma + 1
                results.append(
                    (
                        i,
                        RoundVerdict(
                            accepted=int(accepted[b]),
                            token=None if token[b] < 0 else int(token[b]),
                            entropy_rejection=bool(rejected[b]),
                            target_entropy=tuple(entropy[b * width : (b + 1) * width]),
                        ),
                    )
                )
            return results

        pending.add([verdict.accepted, verdict.token, verdict.entropy_rejection, verdict.target_entropy], finish)

    def _constrain_rounds(self, target: torch.Tensor, seqs: list[Seq], rounds: list[Any]) -> None:
        """The large model's logits ``[R, G+1, V]`` of constrained rounds under the masks their drafts were
        drawn under (kept per position), and, after the drafts, the grammar's mask where it stands now."""
        grammars = {b: seq.grammar for b, seq in enumerate(seqs) if seq.grammar is not None}
        constrained = list(grammars)
        if not constrained:
            return
        width = target.shape[1]
        now = self.grammars.masks(list(grammars.values()))
        words = now.shape[1]
        bitmask = torch.full((len(constrained), width, words), -1, dtype=torch.int32)
        for j, b in enumerate(constrained):
            grammar, first, drafts = grammars[b], rounds[b].first_position, len(rounds[b].tokens)
            for d in range(drafts):
                kept = grammar.mask_at(first + d)
                if kept is None:
                    raise RuntimeError(f"no grammar mask kept for the draft at position {first + d}")
                bitmask[j, d] = kept
            bitmask[j, drafts:] = now[j]
        index = torch.tensor(constrained, device=target.device)
        part = target.index_select(0, index)
        apply_bitmask(part.view(-1, target.shape[-1]), bitmask.view(-1, words))
        target.index_copy_(0, index, part)

    # -- the one result type -----------------------------------------------------------------------

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
        stream = self.stream(requests, timeout_s)
        try:
            for event in stream:
                key = (event.index, event.path)
                if key not in ledgers:  # a branched path's events report no prompt: it shares the prefill
                    counters = requests[event.index].policy.counters()
                    ledgers[key] = CompletionLedger(*info, pricing=pricing, counters=counters)
                    events[key] = []
                ledgers[key].record(event)
                events[key].append(event)
                if event.finish_reason is not None:
                    done[event.index] = time.perf_counter() - start
        finally:
            stream.close()
        out = []
        for i, request in enumerate(requests):
            paths = sorted(path for index, path in events if index == i)
            full = {p: _full_path(events, i, p) for p in paths}
            costs = [ledgers[(i, p)].cost(done[i]) for p in paths]
            cost = costs[0] if len(costs) == 1 else Cost.total(costs, wall_time_s=done[i])
            chosen, votes = request.policy.select(["".join(e.text for e in full[p]) for p in paths])
            out.append(_completion(i, full[paths[chosen]], cost, paths[chosen], len(paths), votes))
        return out


def _rank(work: ForwardWork, read: Read) -> int:
    return 2 if read.verify else 0 if work.tokens > 1 else 1


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
    )


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
