"""The engine: one loaded pair shared by every caller, decoding step by step under each request's policy.

A scheduler thread runs the step loop for all callers at once. One step::

    for plan in scheduler.schedule().passes:     # per model: which rows run, what each reads
        out = runners[plan.role].execute(rows)   # logits only at the positions read: [N, V]
        parts = sample(out) + verify(out)        # sampler and rejection sampler, on the device
        for seq, result in to_host(parts):       # the pass's one host sync
            scheduler.apply(seq, seq.decoder.on_...(seq, result))   # Emit / Draft / Rollback / Fork
    publish(scheduler.finish_step())             # retire, then events to their callers

(A pass whose rows are all greedy drafts runs them as a chain, pass after pass: :meth:`Engine._chain`.)

What callers touch (requests in, events out, settings) is :class:`~ead_llm.core.frontend.Frontend`; prompts become
sequences in :mod:`ead_llm.core.inputs`. Callers get one :class:`TokenEvent` per emitted token through an
:class:`EventStream`; text, stop strings, the ledger and the framework adapters all consume that one stream.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ead_llm.core.frontend import Frontend, check_draft_bfloat16, exact_by_default
from ead_llm.core.heap import frozen_heap
from ead_llm.core.inputs import InputProcessor
from ead_llm.core.kv_cache import DEFAULT_BLOCK_SIZE
from ead_llm.core.loading import LoadConfig, ModelPair
from ead_llm.core.model_runner import ModelRunner, RunnerOutput
from ead_llm.core.ops import entropy_bits, top_two
from ead_llm.core.rejection_sampler import JudgedRounds, verify, verify_batch
from ead_llm.core.sampler import GREEDY, DeviceResults, SampledRows, Sampler, SamplingMetadata, branch_entropy, to_host
from ead_llm.core.scheduler import PassPlan, Scheduler
from ead_llm.core.scheduler import Sequence as Seq
from ead_llm.core.types import DraftRound, ForwardWork, Read, Role, RoundVerdict, TokenSample
from ead_llm.core.validation import check_int

logger = logging.getLogger(__name__)
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    for engine in list(_ENGINES):
        engine.close()


class Engine(Frontend):
    """Decodes requests on a loaded pair for any number of callers (threads or async tasks).

    Callers' requests queue and join the running batch (continuous batching). At most ``max_batch``
    sequences run at once; each model's KV cache is paged in blocks of ``kv_block_size`` positions
    and holds at most ``kv_budget_tokens`` positions (None: grows as needed), so memory follows the
    tokens actually held. With ``return_hidden_states``, each completion (its last event) carries the large model's
    final hidden states at the positions fed to it (SGLang's ``return_hidden_states``; a Llama-family large model).
    A sequence's randomness is its own (its seed, stream and position), so its text does not depend on what else
    runs; in float32 greedy text does not either (``exact_verification``: :attr:`Frontend.exact_verification`).
    In bfloat16, passes of different shapes (a batch, a verification) round differently and near-ties can flip.
    """

    def __init__(
        self,
        pair: ModelPair,
        max_batch: int = 64,
        kv_budget_tokens: int | None = None,
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        return_hidden_states: bool = False,
        exact_verification: bool | None = None,
        draft_bfloat16: bool | None = None,
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
        if not isinstance(return_hidden_states, bool):
            raise ValueError(f"return_hidden_states must be True or False, got {return_hidden_states!r}")
        check_draft_bfloat16(pair, draft_bfloat16)
        self.caches = self._caches()
        large = self.caches[Role.LARGE]
        self.runners = {
            role: ModelRunner(
                pair.model(role),
                pair.device,
                pair.vocab_size,
                self.caches[role],
                target_cache=large if role is Role.SMALL else None,
                draft_bfloat16=draft_bfloat16,
            )
            for role in Role
        }
        if self.runners[Role.SMALL].reads_features or return_hidden_states:  # a draft reads them (EAGLE-style)
            self.runners[Role.LARGE].keep_features(pair.large.info.source)
        self.sampler = Sampler()
        self.scheduler = Scheduler(self.caches, self.max_batch, self.max_positions)
        if return_hidden_states:
            self.scheduler.hidden_size = int(pair.large.model.config.hidden_size)
        self.inputs = InputProcessor(pair, self.max_positions)
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
        self.exact_verification = exact_by_default(pair) if exact_verification is None else exact_verification
        if draft_bfloat16 is not None:
            self.draft_bfloat16 = draft_bfloat16  # warns where it could not be had
        _ENGINES.add(self)

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

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the scheduler thread (failing whatever runs or waits); called at interpreter exit.

        Returns whether it stopped within ``timeout_s``. One still inside a pass stops after it, and
        the next call waits for that before starting a new thread. Stopping it at exit, rather than
        leaving a daemon thread inside torch while the interpreter tears down, avoids an abort.
        """
        with self._cond:
            thread = self._thread
            self._stop.set()
            self.scheduler.abort(RuntimeError("the engine was closed"))
            self._cond.notify_all()
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            logger.warning("the ead-llm scheduler thread is still in a pass; it stops after it")
            return False
        return True

    # -- the scheduler thread --------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        with torch.inference_mode(), frozen_heap():
            while True:
                try:
                    if not self._serve_once(stop):
                        return
                except Exception as exc:  # admission or retirement broke: fail what runs or waits, serve on
                    logger.exception("ead-llm scheduler fault; failing the requests in flight")
                    with self._cond:
                        self.scheduler.abort(exc)

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
            call.put(items)  # one hand-over per caller per step (a whole-completion call's held to its end)
        return True

    def _step(self) -> None:
        for plan in self.scheduler.schedule().passes:
            self._chain(plan) if all(read.chain for read in plan.reads) else self._pass(plan)

    def _execute(self, plan: PassPlan) -> tuple[RunnerOutput, list[int]]:
        """Run ``plan``'s pass: a row that failed alone fails its request; the rows that ran (returned) are billed."""
        runner = self.runners[plan.role]
        out = runner.execute(plan.rows(with_target=runner.reads_features))
        for i, exc in out.failures.items():
            self.scheduler.fail(plan.seqs[i], exc)
        ok = [i for i in range(len(plan.seqs)) if i in out.work]
        for i in ok:
            plan.seqs[i].pending_work.append(out.work[i])
        return out, ok

    def _pass(self, plan: PassPlan) -> None:
        """One model's pass over its rows: run, sample and verify (one host sync), then each decoder's actions."""
        seqs, reads = plan.seqs, plan.reads
        out, ok = self._execute(plan)
        sampled = [i for i in ok if not reads[i].verify]
        verified = [i for i in ok if reads[i].verify]
        parts = [
            *(self._sample(plan.role, seqs, out, sampled) if sampled else []),
            *(self._verify(seqs, out, verified) if verified else []),
        ]
        # decoders act in a fixed order (catch-ups, decodes, verifications): it decides where EAGER's paths compete
        self._act(seqs, sorted(to_host(parts), key=lambda item: (_rank(out.work[item[0]], reads[item[0]]), item[0])))

    def _chain(self, plan: PassPlan) -> None:
        """Greedy drafts (every read a :attr:`Read.chain`): passes back to back, without a step between, each row's
        argmax (the sampler's greedy rule) fed to its next pass, until its chain is drawn or it drew an end of text.
        Its decoder takes each draft as it comes, as it would one per step; the scheduler reserved their room."""
        while plan.seqs:
            out, ok = self._execute(plan)
            logits = out.last_rows(ok)
            drawn = self.sampler(logits, GREEDY)
            tokens, entropy = torch.stack((drawn.tokens.double(), drawn.entropy_bits.double())).tolist()  # one sync
            samples = [TokenSample(plan.role, int(tokens[b]), entropy[b], logits[b]) for b in range(len(ok))]
            self._act(plan.seqs, list(zip(ok, samples, strict=True)))
            more = [i for i in ok if plan.reads[i].chain > 1 and not _ended(plan.seqs[i])]
            reads = [Read(plan.role, chain=plan.reads[i].chain - 1) for i in more]
            plan = PassPlan(plan.role, [plan.seqs[i] for i in more], reads)

    def _act(self, seqs: list[Seq], results: list[tuple[int, Any]]) -> None:
        """Each row's decoder takes its result, in the order given; the scheduler carries out its actions."""
        room = self.scheduler.fork_room()
        for i, result in results:
            seq = seqs[i]
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

    def _per_row(
        self, seqs: list[Seq], rows: list[int], run: Callable[[list[int]], DeviceResults]
    ) -> list[DeviceResults]:
        """``run`` a batched stage over ``rows`` (indices into ``seqs``); if it raises, over each row alone, so that
        a row that still fails fails its own request only."""
        try:
            return [run(rows)]
        except Exception as exc:
            if len(rows) == 1:
                raise
            error = exc
        parts = []
        for row in rows:
            try:
                parts.append(run([row]))
            except Exception as exc:
                self.scheduler.fail(seqs[row], exc)
        if len(parts) == len(rows):  # no row's fault: row by row hides it, so say so
            logger.warning("a stage over %d rows failed (%r) where each row alone succeeded", len(rows), error)
        return parts

    def _sample(self, role: Role, seqs: list[Seq], out: RunnerOutput, rows: list[int]) -> list[DeviceResults]:
        """The sampler over ``rows``' last read positions, after their grammars' masks."""
        logits = out.last_rows(rows)  # [B, V], in the order of rows
        chosen = [seqs[i] for i in rows]
        grammars = [q.grammar for q in chosen]
        constrained = any(grammars)
        raw = entropy_bits(logits) if constrained and not self.entropy_after_mask else None
        if constrained:  # the grammar machinery exists only once a request has a constraint
            for b, error in self.grammars.constrain(logits, grammars).items():
                self.scheduler.fail(chosen[b], error)
        at = {row: b for b, row in enumerate(rows)}

        def run(part: list[int]) -> SampledRows:
            index = [at[i] for i in part]
            mine = logits if len(part) == len(rows) else logits[index]  # [b, V]
            them = [seqs[i] for i in part]
            meta = SamplingMetadata.build(
                [(q.params.temperature, q.params.top_k, q.params.top_p, q.key, len(q.tokens)) for q in them],
                logits.device,
            )
            drawn = self.sampler(mine, meta)
            entropy = drawn.entropy_bits if raw is None else raw if len(part) == len(rows) else raw[index]
            stats = any(q.decoder.branch_stats for q in them)
            branch = (*top_two(mine), branch_entropy(mine, [q.decoder.branch_top_k for q in them])) if stats else None
            keep = any(q.decoder.reads_logits for q in them)  # a row of logits per sample only where it is read
            return SampledRows(role, part, mine, drawn.tokens, entropy, branch, keep)

        return self._per_row(seqs, rows, run)

    def _verify(self, seqs: list[Seq], out: RunnerOutput, rows: list[int]) -> list[DeviceResults]:
        """The rejection sampler over ``rows``' rounds, the large model's logits under the drafts' masks."""
        rounds: dict[int, DraftRound] = {}
        for i in rows:
            try:
                rounds[i] = seqs[i].decoder.draft_round(seqs[i])
            except Exception as exc:  # a broken round fails its own request
                self.scheduler.fail(seqs[i], exc)
        live = [i for i in rows if i in rounds]
        if not live:
            return []
        gamma = max(len(rounds[i].tokens) for i in live)
        target = out.padded_rows(live, gamma + 1)  # [R, G+1, V], in the order of live
        grammars = [seqs[i].grammar for i in live]
        if any(grammars):
            for j, error in self.grammars.constrain_rounds(target, grammars, [rounds[i] for i in live]).items():
                self.scheduler.fail(seqs[live[j]], error)
        at = {row: j for j, row in enumerate(live)}

        def run(part: list[int]) -> JudgedRounds:
            them = [seqs[i] for i in part]
            batch = verify_batch(
                [q.params for q in them],
                [q.key for q in them],
                [rounds[i] for i in part],
                target if len(part) == len(live) else target[[at[i] for i in part]],
                gamma,
                out.sibling_rows(part, gamma),
            )
            return JudgedRounds(part, verify(batch))

        return self._per_row(seqs, live, run)


def _ended(seq: Seq) -> bool:
    return seq.finished or seq.is_end(seq.tokens[-1])


def _rank(work: ForwardWork, read: Read) -> int:
    return 2 if read.verify else 0 if work.tokens > 1 else 1
