"""The DSPy engine of ``EntropyAdaptiveLLM``: ``complete(lm15.Request) -> lm15.Response`` on the pair.

This is DSPy 3.4's supported route for a custom LM (``dspy.LM(model, engine=..., async_engine=...)``).
DSPy owns the cache, history, usage tracking and the ``n`` candidates (one ``complete`` per
candidate); this engine turns one canonical request into one engine call (a ``response_format``, as DSPy's
JSONAdapter sends, becomes a grammar constraint: the JSON always parses). Candidate ``k`` of a DSPy
call draws from the seed's random stream ``k``, so ``n=3`` at a temperature gives three different
samples, the same three every time.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dspy.clients.engines.base import validate_request
from dspy.lm15 import (
    ContextLengthError,
    Message,
    Response,
    StreamDeltaEvent,
    StreamEndEvent,
    StreamStartEvent,
    TextDelta,
    UnsupportedFeatureError,
    Usage,
)
from dspy.lm15 import Request as LMRequest

from ead_llm.accounting.ledger import Cost
from ead_llm.adapters.dspy_formats import chat_adapter_constraint
from ead_llm.adapters.prompts import render
from ead_llm.core.grammar import DEFAULT_BOUNDS, Constraint, JsonBounds, ResponseFormatError
from ead_llm.core.request import Completion, PromptTooLongError, Request
from ead_llm.core.types import TokenEvent

if TYPE_CHECKING:
    from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM


@dataclass
class _Scope:
    """The DSPy call in progress: its candidates so far, and its rollout id."""

    candidates: itertools.count[int]
    rollout: Any
    ran: int = 0
    """Engine runs made for this call (0 when DSPy's cache answered it)."""


_SCOPE: ContextVar[_Scope | None] = ContextVar("ead_llm_dspy_call", default=None)


@contextmanager
def candidate_scope(rollout: Any = None) -> Iterator[None]:
    """Number the ``complete`` calls of one DSPy call (the k-th draws from random stream k) and keep its
    ``rollout_id`` (another rollout draws from other streams of the seed)."""
    token = _SCOPE.set(_Scope(itertools.count(), rollout))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _next_candidate() -> tuple[int | None, Any]:
    scope = _SCOPE.get()
    if scope is None:
        return None, None
    scope.ran += 1
    return next(scope.candidates), scope.rollout


def answered_from_cache() -> bool:
    """Whether the DSPy call in progress was answered without running the engine (a cache hit)."""
    scope = _SCOPE.get()
    return scope is not None and scope.ran == 0


def rollout_seed(seed: int | None, rollout: Any) -> int | None:
    """The seed of one rollout: ``seed`` itself without a rollout id, else one derived from both (stable
    across processes); None (a fresh seed per call) stays None."""
    if seed is None or rollout is None:
        return seed
    digest = hashlib.sha256(f"ead-llm-rollout/{seed}/{rollout!r}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _text_of(parts: Any) -> str:
    return "".join(getattr(p, "text", "") or "" for p in parts)


def _messages(request: LMRequest) -> list[tuple[str, str]]:
    """``(role, text)`` turns of a canonical request; refuses content the pair cannot read."""
    turns: list[tuple[str, str]] = []
    if request.system is not None:
        turns.append(("system", request.system if isinstance(request.system, str) else _text_of(request.system)))
    for message in request.messages:
        kinds = {type(p).__name__ for p in message.parts} - {"TextPart"}
        if kinds or message.role not in ("user", "assistant"):
            raise UnsupportedFeatureError(
                f"ead-llm pairs read text turns from users and the assistant only; got a {message.role} message "
                f"with {sorted(kinds) or 'text'} parts"
            )
        turns.append((message.role, _text_of(message.parts)))
    return turns


_UNSUPPORTED_CONFIG = (
    "tool_choice",
    "reasoning",
    "logprobs",
    "probabilities",
    "frequency_penalty",
    "presence_penalty",
)


def response_constraint(value: Any, bounds: JsonBounds | None = DEFAULT_BOUNDS) -> Constraint | None:
    """The constraint of a canonical ``response_format`` (what DSPy's JSONAdapter asks for): ``json_object``,
    ``json_schema`` (lm15's flat shape or OpenAI's nested one), or a pydantic model class; a shape it cannot
    read is DSPy's ``UnsupportedFeatureError``."""
    try:
        return Constraint.response_format(value, bounds=bounds)
    except ResponseFormatError as exc:
        raise UnsupportedFeatureError(str(exc)) from exc


def _usage(cost: Cost) -> Usage:
    """DSPy's usage; ``cache_read_tokens``: the prompt tokens the large model took from its prefix cache."""
    return Usage(
        input_tokens=cost.prompt_tokens,
        output_tokens=cost.completion_tokens,
        total_tokens=cost.prompt_tokens + cost.completion_tokens,
        cache_read_tokens=cost.large_cached_tokens or None,
    )


def _options(request: LMRequest) -> dict[str, Any]:
    """Per-call sampling overrides carried by ``request.config`` (a ``response_format`` becomes the
    engine's grammar constraint)."""
    config = request.config
    refused = [name for name in _UNSUPPORTED_CONFIG if getattr(config, name, None) is not None]
    extensions = {k: v for k, v in (config.extensions or {}).items() if k != "metadata"}  # tags: no effect
    if request.tools or refused or extensions:
        names = refused + (["tools"] if request.tools else []) + sorted(extensions)
        raise UnsupportedFeatureError(
            f"ead-llm cannot honour {names}: use a text adapter "
            "(ChatAdapter, or CompletionAdapter on the embedded pair)"
        )
    options = {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "max_tokens": config.max_tokens,
        "seed": config.seed,
    }
    out = {k: v for k, v in options.items() if v is not None}
    constraint = response_constraint(config.response_format)
    if constraint is not None:
        out["grammar"] = constraint
    return out


@contextmanager
def _context_length_errors() -> Iterator[None]:
    """An overlong prompt as DSPy's error for it (ReAct and others catch it to shorten their history)."""
    try:
        yield
    except PromptTooLongError as exc:
        raise ContextLengthError(str(exc)) from exc


class PairEngine:
    """Sync DSPy engine over the owner's shared engine (created per use; holds no state of its own)."""

    supports_function_calling = False
    supports_reasoning = False
    supports_response_schema = True
    supported_params = frozenset(
        {"temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "n", "response_format"}
    )

    def __init__(self, owner: EntropyAdaptiveLLM) -> None:
        self.owner = owner

    def _request(self, request: LMRequest) -> Request:
        validate_request(request)
        owner = self.owner
        turns = _messages(request)
        prompt = render(owner.shared_engine.tokenizer, turns, owner.model_type)
        stop = list(request.config.stop) or None
        candidate, rollout = _next_candidate()
        options = _options(request)
        enforce = owner.enforce_adapter_format and owner.model_type == "chat" and not owner.ignore_eos
        if "grammar" not in options and enforce:  # (ignore_eos: a benchmark run, past any format's end)
            budget = options.get("max_tokens", owner.max_tokens)
            constraint = chat_adapter_constraint(turns, owner.json_bounds, budget)
            if constraint is not None:
                options["grammar"] = constraint
        seed = rollout_seed(options.get("seed", owner.seed), rollout)
        if seed is not None:
            options["seed"] = seed
        (engine_request,) = owner._requests([prompt], stop, options, sample_index=candidate)
        return engine_request

    def _provider_data(self, cost: Cost, models: str) -> dict[str, Any]:
        return {
            "cost": cost.to_dict(),
            "models": models,
            "small_params": cost.small_params,
            "large_params": cost.large_params,
        }

    def complete(self, request: LMRequest) -> Response:
        """Run one candidate to completion."""
        engine_request = self._request(request)
        with _context_length_errors():
            (completion,), cost = self.owner._run([engine_request])
        return self._response(request, completion, cost)

    def _response(self, request: LMRequest, completion: Completion, cost: Cost) -> Response:
        return Response(
            id=None,
            model=request.model,
            message=Message.assistant(completion.text),
            finish_reason=completion.finish_reason.value,
            usage=_usage(cost),
            provider_data=self._provider_data(cost, "".join(r.letter for r in completion.roles)),
        )

    def stream(self, request: LMRequest) -> Iterator[Any]:
        """lm15 stream events: start, one text delta per token, end with usage and the cost."""
        engine_request = self._request(request)
        with _context_length_errors():
            events = self.owner._stream_events(engine_request)
        yield StreamStartEvent(model=request.model)
        models: list[str] = []
        for event, cost in events:
            yield from self._stream_items(event, cost, models)

    async def astream(self, request: LMRequest) -> AsyncIterator[Any]:
        """:meth:`stream` on the event loop (no thread per token; cancelling frees the engine)."""
        engine_request = self._request(request)
        with _context_length_errors():
            events = await self.owner._aopen_events(engine_request)
        yield StreamStartEvent(model=request.model)
        models: list[str] = []
        try:
            async for event, cost in events:
                for item in self._stream_items(event, cost, models):
                    yield item
        finally:  # a consumer that stops early frees the sequence now, not when the generator is collected
            await events.aclose()  # type: ignore[attr-defined]

    def _stream_items(self, event: TokenEvent, cost: Cost | None, models: list[str]) -> Iterator[Any]:
        models.append(event.role.letter)
        if event.text:
            yield StreamDeltaEvent(delta=TextDelta(text=event.text))
        if cost is not None and event.finish_reason is not None:
            yield StreamEndEvent(
                finish_reason=event.finish_reason.value,
                usage=_usage(cost),
                provider_data=self._provider_data(cost, "".join(models)),
            )

    def close(self) -> None:
        """Nothing to close: the shared engine outlives every LM object."""


class AsyncPairEngine:
    """Async DSPy engine: awaits the shared engine on the event loop, so cancelling the awaiting task (a
    timeout, ``asyncio.wait_for``) stops the decoding within one engine step."""

    supports_function_calling = False
    supports_reasoning = False
    supports_response_schema = True

    def __init__(self, sync: PairEngine) -> None:
        self.sync = sync

    async def complete(self, request: LMRequest) -> Response:
        engine_request = self.sync._request(request)
        with _context_length_errors():
            (completion,), cost = await self.sync.owner._arun([engine_request])
        return self.sync._response(request, completion, cost)

    async def stream(self, request: LMRequest) -> AsyncIterator[Any]:
        async for event in self.sync.astream(request):
            yield event

    async def aclose(self) -> None:
        """Nothing to close."""
