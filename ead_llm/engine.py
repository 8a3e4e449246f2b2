"""The engine: one loaded pair shared by every caller, decoding step by step under a policy.

Each step the engine asks every live sequence's policy which model produces its next token,
groups the sequences by that model, has the model's runner return next-token logits for the
group (catching each cache up on what it has not seen), samples, and yields one
:class:`TokenEvent` per emitted token. Text, stop strings, the ledger and the framework
adapters all consume that one stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ead_llm.ledger import CompletionLedger, Cost, Pricing
from ead_llm.loading import LoadConfig, ModelPair
from ead_llm.ops import entropy_bits
from ead_llm.policies import Policy, check_policy
from ead_llm.runner import ForwardRow, ModelCache, ModelRunner
from ead_llm.sampling import Sampler, SamplingParams, request_generator
from ead_llm.text import IncrementalDetokenizer, StopMatcher
from ead_llm.types import FinishReason, ForwardWork, Role, TokenEvent
from ead_llm.validation import check_float, check_int

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Request:
    """One prompt to complete, with its policy and sampling settings."""

    prompt: Prompt
    policy: Policy
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample_index: int | None = None
    """Which of the seed's random streams this request draws from; None: its position in the call.
    (The k-th of n samples of one prompt uses stream k, whichever way the n are asked for.)"""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            try:
                ids = tuple(self.prompt)
            except TypeError:
                raise ValueError(f"prompt must be a string or a list of token ids, got {self.prompt!r}") from None
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError("prompt token ids must be integers")
            object.__setattr__(self, "prompt", ids)
        check_policy(self.policy)
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if self.sample_index is not None:
            check_int("sample_index", self.sample_index, minimum=0)


@dataclass(frozen=True)
class Completion:
    """The one result type: a finished sequence with its tokens, provenance and cost."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    roles: tuple[Role, ...]
    """Which model emitted each token."""
    entropies: tuple[float, ...]
    """Entropy (bits, raw logits) of the distribution each token was drawn from."""
    finish_reason: FinishReason
    cost: Cost


@dataclass
class _Sequence:
    index: int
    tokens: list[int]
    prompt_len: int
    policy: Policy
    state: Any
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    stops: StopMatcher
    caches: dict[Role, ModelCache]
    generated: int = 0
    finished: bool = False

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
    """Decodes requests on a loaded pair. Thread-safe: concurrent calls run one after another."""

    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.tokenizer = pair.tokenizer
        self.runners = {role: ModelRunner(pair.model(role), pair.device, pair.vocab_size) for role in Role}
        self.sampler = Sampler()
        limits = [m.info.max_positions for m in (pair.small, pair.large) if m.info.max_positions]
        self.max_positions: int | None = min(limits) if limits else None
        self._lock = threading.Lock()
        self.load_config: LoadConfig | None = None
        """Set by the registry: how to load this pair again (pickling an object that holds the engine
        stores this instead of the weights)."""

    def __reduce__(self) -> tuple[Any, tuple[LoadConfig]]:
        """Pickled as the pair's load settings; unpickling finds (or loads) the shared engine."""
        if self.load_config is None:
            raise TypeError("this Engine was built from a ModelPair directly; only shared engines can be pickled")
        from ead_llm.registry import shared_engine

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
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the models accept at most {self.max_positions} positions "
                "in all: shorten the prompt"
            )
        return ids

    # -- decoding --------------------------------------------------------------------------------

    def _start(self, index: int, request: Request) -> _Sequence:
        ids = self.encode(request.prompt)
        return _Sequence(
            index=index,
            tokens=ids,
            prompt_len=len(ids),
            policy=request.policy,
            state=request.policy.start(),
            params=request.sampling,
            generator=request_generator(
                request.sampling.seed, index if request.sample_index is None else request.sample_index
            ),
            detok=IncrementalDetokenizer(self.tokenizer, ids),
            stops=StopMatcher(request.sampling.stop),
            caches={role: ModelCache() for role in Role},
        )

    def stream(self, requests: Sequence[Request]) -> Generator[TokenEvent, None, None]:
        """Yield one event per generated token of every request, interleaved across requests.

        Requests are checked (and prompts encoded) before anything runs. Holds the engine while
        it runs; close the iterator (or exhaust it) to let other callers in.
        """
        _check_requests(requests)
        if not requests:
            return
        with self._lock, torch.inference_mode():
            sequences = [self._start(i, r) for i, r in enumerate(requests)]
            try:
                live = sequences
                while live:
                    yield from self._step(live)
                    live = [s for s in live if not s.finished]
            finally:
                for seq in sequences:
                    seq.release()

    def _step(self, live: list[_Sequence]) -> Iterator[TokenEvent]:
        groups: dict[Role, list[_Sequence]] = {}
        for seq in live:
            groups.setdefault(seq.policy.choose(seq.state), []).append(seq)
        for role, group in sorted(groups.items(), key=lambda item: item[0].value):
            rows = [ForwardRow(seq.caches[role], seq.tokens) for seq in group]
            logits, work = self.runners[role].forward(rows)  # logits: [B, V]
            entropies = entropy_bits(logits).tolist()  # [B]
            for seq, row_logits, row_work, entropy in zip(group, logits, work, entropies, strict=True):
                token = self.sampler.sample(row_logits, seq.params, seq.generator)
                seq.state = seq.policy.advance(seq.state, role, entropy)
                yield self._emit(seq, token, role, entropy, (row_work,))

    def _emit(
        self, seq: _Sequence, token: int, role: Role, entropy: float, work: tuple[ForwardWork, ...]
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
        )

    def generate(
        self, requests: Sequence[Request], pricing: Pricing | None = None, timeout_s: float | None = None
    ) -> list[Completion]:
        """Run requests to completion and return one :class:`Completion` per request, in order.

        With ``timeout_s``, a call still running after that many seconds raises ``TimeoutError``;
        its sequences' caches are freed.
        """
        _check_requests(requests)
        if timeout_s is not None:
            check_float("timeout_s", timeout_s, minimum=0.0, exclusive_minimum=True)
        start = time.perf_counter()
        info = (self.pair.small.info, self.pair.large.info)
        ledgers = [CompletionLedger(*info, len(self.encode(r.prompt)), pricing) for r in requests]
        events: list[list[TokenEvent]] = [[] for _ in requests]
        done: dict[int, float] = {}
        stream = self.stream(requests)
        try:
            for event in stream:
                ledgers[event.index].record(event)
                events[event.index].append(event)
                elapsed = time.perf_counter() - start
                if event.finish_reason is not None:
                    done[event.index] = elapsed
                elif timeout_s is not None and elapsed > timeout_s:
                    raise TimeoutError(
                        f"the call took longer than {timeout_s} s: raise the timeout or lower max_tokens"
                    )
        finally:
            stream.close()
        return [self._completion(i, events[i], ledgers[i].cost(done[i])) for i in range(len(requests))]

    @staticmethod
    def _completion(index: int, events: list[TokenEvent], cost: Cost) -> Completion:
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
        )
