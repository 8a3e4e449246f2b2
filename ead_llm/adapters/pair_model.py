"""``PairModel``: the settings and engine access that every framework adapter shares.

``EntropyAdaptiveLLM`` (LangChain LLM + DSPy LM) and ``ChatEntropyAdaptive`` (LangChain chat
model) are thin adapters over this: they turn their framework's input into engine requests with
:meth:`PairModel._requests`, run them with :meth:`PairModel._run` or
:meth:`PairModel._stream_events`, and convert the one result type at their edge.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ConfigDict, PrivateAttr, ValidationInfo, field_serializer, field_validator, model_validator
from tenacity import AsyncRetrying, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ead_llm import __version__
from ead_llm.accounting.ledger import CompletionLedger, Cost, Pricing
from ead_llm.accounting.tracking import report
from ead_llm.adapters.prompts import PromptFormat
from ead_llm.core.engine import Engine
from ead_llm.core.grammar import DEFAULT_BOUNDS, Constraint, JsonBounds, schema_of
from ead_llm.core.loading import LoadConfig, LoadOptions, model_source
from ead_llm.core.registry import shared_engine
from ead_llm.core.request import Completion, Prompt, Request, SamplingParams
from ead_llm.core.types import FinishReason, TokenEvent
from ead_llm.core.validation import check_float, check_int, check_stop
from ead_llm.embedded import embedded_pair, recommended_policy
from ead_llm.optimize.calibrate import stored_policy
from ead_llm.policies.base import Policy, check_policy, describe_policy, policy_from_description
from ead_llm.policies.speculative import SpeculativeDecoding

CALL_OPTIONS = (
    "policy",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "ignore_eos",
    "prompt_truncation",
    "json_schema",
    "regex",
    "grammar",
)
"""Settings a single call may override (``llm.invoke(x, policy=SmallOnly())`` or ``llm.bind(...)``)."""
CONSTRAINT_OPTIONS = ("json_schema", "regex", "grammar")

EMBEDDED_NAME = "embedded"
LOAD_FIELDS = tuple(LoadOptions.model_fields)
"""The fields passed on to :class:`~ead_llm.core.loading.LoadConfig` as they are."""
IDENTITY_FIELDS = (
    "small",
    "large",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "stop",
    "ignore_eos",
    "prompt_truncation",
    "prompt_format",
    "dtype",
    "revision",
    "json_schema",
    "regex",
    "grammar",
    "json_bounds",
)
"""Fields that decide the text (with the policy): what a cache key and ``asdict()`` hold."""
DESCRIPTION_KEYS = frozenset({"_type", "ead_llm_version"})
"""Keys of ``asdict()`` that are not constructor arguments."""


logger = logging.getLogger(__name__)
_TOLD: set[tuple[str, str]] = set()


def _uncalibrated(small: str, large: str) -> Policy:
    """The policy of a pair with no calibration (said once per pair and process)."""
    if (small, large) not in _TOLD:
        _TOLD.add((small, large))
        logger.warning(
            "no calibrated EAD threshold for %s + %s: decoding with SpeculativeDecoding() (LargeOnly's text); "
            "ead_llm.calibrate(llm, examples) chooses and stores one",
            small,
            large,
        )
    return SpeculativeDecoding()


class PairModel(LoadOptions):
    """Which pair to run and how to decode; shared by the LangChain and DSPy adapters. How the pair is loaded
    (``device``, ``dtype``, ``revision``...) are :class:`~ead_llm.core.loading.LoadOptions`' fields."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    small: str | None = None
    """Hugging Face id or local folder of the small model (None: the embedded pair)."""
    large: str | None = None
    """Hugging Face id or local folder of the large model (None: the embedded pair)."""
    policy: Policy | None = None
    """Which model speaks when: EAD(...), SmallOnly(), LargeOnly(). None: on the embedded pair the EAD settings
    chosen for it on the task's dev split (``recommended_policy()``); on another pair the policy
    ``ead_llm.calibrate`` stored for it, else SpeculativeDecoding() (greedy, its text is LargeOnly's)."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    max_tokens: int = 256
    """Most tokens generated per completion."""
    seed: int | None = 0
    """Seed of each call's random generators; the same seed and inputs give the same text."""
    stop: list[str] | None = None
    """Default stop strings, used when a call passes none."""
    ignore_eos: bool = False
    """Generate past EOS (for fixed-length benchmarks)."""
    prompt_truncation: Literal["error", "left"] = "error"
    """A prompt longer than the context: ``error`` refuses it (ValueError); ``left`` drops its oldest
    tokens (keeping a leading BOS) so that it and ``max_tokens`` fit."""
    json_schema: Any = None
    """Constrain every completion to one JSON value valid under this schema (a dict, JSON text, a pydantic
    model or a TypedDict), whichever model writes each token. Usually passed per call."""
    regex: str | None = None
    """Constrain every completion to match this regular expression in full."""
    grammar: Any = None
    """Constrain every completion to this Lark grammar (llguidance's dialect), or to a ``Constraint``."""
    json_bounds: JsonBounds | None = DEFAULT_BOUNDS
    """Length bounds of JSON the model writes under a schema (``json_schema``, structured output, tool
    arguments) where the schema sets none: strings, integers, decimals, arrays (see ``JsonBounds``), so a weak
    model ends a structured answer instead of looping to ``max_tokens``. None lifts them."""
    timeout: float | None = None
    """Seconds one call may take; past it the call raises ``TimeoutError`` and frees its caches."""
    max_retries: int = 2
    """Retries of a call whose forward pass ran out of accelerator memory (nothing retried once
    text has been streamed)."""
    prompt_format: PromptFormat | None = None
    """How a conversation becomes the prompt: ``chat`` (the tokenizer's chat template, or a plain
    fallback) or ``text`` (the texts joined raw). None: ``text`` on the embedded pair, else ``chat``."""
    max_batch: int | None = None
    """Most sequences the shared engine decodes at once (None: its current setting, 64 by default).
    Objects sharing a pair share the engine and so its limits."""
    kv_budget_tokens: int | None = None
    """Most KV positions each model's paged cache holds at once (its memory bound, in blocks of 16):
    requests beyond it wait, and the newest running ones give their blocks back if the others need
    them. A request that could not finish alone (prompt + max_tokens over the budget) is refused.
    None: the shared engine's current setting (unlimited by default)."""
    prefix_caching: bool | None = None
    """Reuse the KV blocks of prompts (and answers) the engine saw before: a call that starts like an earlier
    one computes only the rest (the bill's ``large_cached_tokens``/``small_cached_tokens``). None: the shared
    engine's current setting (on by default); False turns it off for the engine, and every object sharing it."""
    exact_verification: bool | None = None
    """Attend each token a verification checks as a one-token decode step would, so greedy speculative decoding is
    LargeOnly's to the last bit (see the guide for its cost). None: the shared engine's current setting (by default
    on for large models of 50M parameters or more); a bool sets it for the engine, and every object sharing it."""
    draft_bfloat16: bool | None = None
    """Run the products of a draft that reads its target's hidden states (``ead-llm distill``) in bfloat16: about
    half their time on a CPU with bfloat16 in hardware; greedy speculative decoding's text is unchanged. None: the
    shared engine's current setting (by default on where it pays); a bool sets it for the engine (True only for
    such a draft)."""
    pricing: Pricing | None = None
    """USD per million tokens per model; adds ``cost_usd`` to the cost dict."""

    _engine: Engine = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _drop_description_keys(cls, data: Any) -> Any:
        """Accept what ``asdict()``/``save()`` write: LangChain's ``_type`` and our version marker."""
        if isinstance(data, dict) and DESCRIPTION_KEYS & set(data):
            return {k: v for k, v in data.items() if k not in DESCRIPTION_KEYS}
        return data

    @field_validator("policy", mode="before")
    @classmethod
    def _check_policy(cls, value: Any) -> Policy | None:
        """A policy object, or its description (``{"policy": "ead", "threshold": 0.1}``, as dumped)."""
        if value is None:
            return None
        return policy_from_description(value) if isinstance(value, dict) else check_policy(value)

    @field_serializer("policy")
    def _dump_policy(self, policy: Policy | None) -> dict[str, Any] | None:
        """Dumped with its type and settings, so that ``model_validate(model_dump())`` rebuilds it."""
        return None if policy is None else describe_policy(policy)

    @field_validator("small", "large", mode="before")
    @classmethod
    def _check_source(cls, value: Any, info: ValidationInfo) -> str | None:
        return None if value is None else model_source(str(info.field_name), value)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str] | None:
        return None if value is None else list(check_stop(value))

    @field_validator("timeout", mode="before")
    @classmethod
    def _check_timeout(cls, value: Any) -> float | None:
        return None if value is None else check_float("timeout", value, minimum=0.0, exclusive_minimum=True)

    @field_validator("max_retries", mode="before")
    @classmethod
    def _check_retries(cls, value: Any) -> int:
        return check_int("max_retries", value, minimum=0)

    def model_post_init(self, context: Any) -> None:
        """Check the settings, then attach the shared engine (loading the pair on first use)."""
        self._sampling({}, None)
        if self.small is None or self.large is None:
            if self.small is not None or self.large is not None:
                raise ValueError("pass both small= and large=, or neither for the embedded default pair")
            small, large = embedded_pair()
            if self.policy is None:
                self.policy = recommended_policy()
        else:
            small, large = self.small, self.large
        config = LoadConfig(small=small, large=large, **self.load_options())
        self._engine = shared_engine(config)
        self._engine.set_limits(self.max_batch, self.kv_budget_tokens)
        if self.prefix_caching is not None:
            self._engine.prefix_caching = self.prefix_caching
        if self.exact_verification is not None:
            self._engine.exact_verification = self.exact_verification
        if self.draft_bfloat16 is not None:
            self._engine.draft_bfloat16 = self.draft_bfloat16
        if self.policy is None:
            self.policy = stored_policy(small, large) or _uncalibrated(small, large)

    @property
    def shared_engine(self) -> Engine:
        """The engine running this object's pair, shared with every object naming the same pair."""
        return self._engine

    @property
    def pair_name(self) -> str:
        """``embedded`` or ``small+large`` as given."""
        return EMBEDDED_NAME if self.small is None else f"{self.small}+{self.large}"

    @property
    def model_name(self) -> str:
        """A short name for usage records and traces: ``ead-llm/embedded``, or ``ead-llm/`` and the large model's
        name (its folder's or file's last part, or its Hub id); the policy is reported in its own field."""
        if self.large is None:
            return f"ead-llm/{EMBEDDED_NAME}"
        path = Path(self.large)
        if path.is_absolute() or path.exists():
            return f"ead-llm/{path.name.removesuffix('.gguf')}"
        return f"ead-llm/{self.large}"

    @property
    def resolved_prompt_format(self) -> PromptFormat:
        """The prompt format in use (``prompt_format``, or its default for this pair)."""
        if self.prompt_format is not None:
            return self.prompt_format
        return "text" if self.small is None else "chat"

    def _policy(self) -> Policy:
        if self.policy is None:  # set in model_post_init; only a bypassed constructor leaves it unset
            raise RuntimeError(f"{type(self).__name__} has no policy")
        return self.policy

    # -- per-call settings ------------------------------------------------------------------------

    def _constraint(self, options: dict[str, Any]) -> Constraint | None:
        """The call's constraint: at most one of ``json_schema``, ``regex``, ``grammar`` (call or default)."""
        given = {name: options.get(name, getattr(self, name)) for name in CONSTRAINT_OPTIONS}
        given = {name: value for name, value in given.items() if value is not None}
        if len(given) > 1:
            raise ValueError(f"pass at most one of json_schema, regex and grammar; got {sorted(given)}")
        if not given:
            return None
        ((name, value),) = given.items()
        if isinstance(value, Constraint):
            return value
        if name == "json_schema":
            return Constraint.json_schema(value, bounds=self.json_bounds)
        if name == "regex":
            return Constraint.regex(value)
        return Constraint.lark(value)

    def _sampling(self, options: dict[str, Any], stop: Sequence[str] | None) -> SamplingParams:
        return SamplingParams(
            temperature=options.get("temperature", self.temperature),
            top_p=options.get("top_p", self.top_p),
            top_k=options.get("top_k", self.top_k),
            max_tokens=options.get("max_tokens", self.max_tokens),
            stop=check_stop(stop if stop is not None else self.stop),
            seed=options.get("seed", self.seed),
            ignore_eos=options.get("ignore_eos", self.ignore_eos),
            prompt_truncation=options.get("prompt_truncation", self.prompt_truncation),
            constraint=self._constraint(options),
        )

    @staticmethod
    def _call_options(kwargs: dict[str, Any]) -> dict[str, Any]:
        """The per-call overrides in ``kwargs``; anything else is refused with the accepted names."""
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise ValueError(f"unknown call options {unknown}; accepted: {list(CALL_OPTIONS)}")
        return dict(kwargs)

    def _requests(
        self,
        prompts: Sequence[Prompt],
        stop: Sequence[str] | None,
        kwargs: dict[str, Any],
        sample_index: int | None = None,
    ) -> list[Request]:
        options = self._call_options(kwargs)
        policy = check_policy(options.get("policy", self.policy))
        sampling = self._sampling(options, stop)
        return [Request(prompt=p, policy=policy, sampling=sampling, sample_index=sample_index) for p in prompts]

    def _identity(self) -> dict[str, Any]:
        """Everything that decides the output, as constructor arguments: LangChain's cache key, its trace
        parameters and ``asdict()`` (so ``type(llm)(**llm.asdict())`` rebuilds it). The pair is named as
        given (never by an install's absolute path); the embedded pair by the package version that ships it."""
        out: dict[str, Any] = {name: getattr(self, name) for name in IDENTITY_FIELDS}
        for name in CONSTRAINT_OPTIONS:
            value = out[name]
            if isinstance(value, Constraint):
                out[name] = value.describe()
            elif isinstance(value, type):
                out[name] = schema_of(value)
        if out["json_bounds"] is not None:
            out["json_bounds"] = dataclasses.asdict(out["json_bounds"])
        policy = self.policy  # a per-call option is checked inside the run, so it may not be a policy yet
        out["policy"] = describe_policy(policy) if isinstance(policy, Policy) else repr(policy)
        if self.small is None:
            out["ead_llm_version"] = __version__
        return out

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` as the engine bills a prompt (special tokens such as BOS included)."""
        return self._engine.encode(text)

    # -- running ----------------------------------------------------------------------------------

    def _retries(self, kind: type[Retrying] | type[AsyncRetrying]) -> Any:
        """Retries of a call whose forward pass ran out of accelerator memory (``max_retries``)."""
        return kind(
            retry=retry_if_exception_type(torch.OutOfMemoryError),
            stop=stop_after_attempt(self.max_retries + 1),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            reraise=True,
        )

    def _run(self, requests: list[Request]) -> tuple[list[Completion], Cost]:
        """Run requests to completion; returns the completions and the call's summed cost."""
        start = time.perf_counter()
        completions = self._retries(Retrying)(
            self._engine.generate, requests, pricing=self.pricing, timeout_s=self.timeout
        )
        return completions, self._total(completions, start)

    async def _arun(self, requests: list[Request]) -> tuple[list[Completion], Cost]:
        """:meth:`_run` for async callers: cancelling the awaiting task stops the requests within one step."""
        start = time.perf_counter()
        completions = await self._retries(AsyncRetrying)(
            self._engine.agenerate, requests, pricing=self.pricing, timeout_s=self.timeout
        )
        return completions, self._total(completions, start)

    @staticmethod
    def _total(completions: list[Completion], start: float) -> Cost:
        total = Cost.total([c.cost for c in completions], wall_time_s=time.perf_counter() - start)
        report(total)
        return total

    def _ledger(self, request: Request) -> CompletionLedger:
        """The ledger of one streamed request (a voting policy cannot stream: refused here)."""
        if request.policy.votes:
            raise ValueError(
                f"{type(request.policy).__name__} answers by a vote once every path has finished: "
                "use invoke/generate, not stream"
            )
        pair = self._engine.pair
        return CompletionLedger(
            pair.small.info, pair.large.info, pricing=self.pricing, counters=request.policy.counters()
        )

    @staticmethod
    def _billed(event: TokenEvent, ledger: CompletionLedger, start: float) -> tuple[TokenEvent, Cost | None]:
        """``event`` recorded, with the completion's cost on the last one."""
        ledger.record(event)
        if event.finish_reason is None:
            return event, None
        cost = ledger.cost(time.perf_counter() - start)
        report(cost)
        return event, cost

    def _stream_events(self, request: Request, until: Until | None = None) -> Iterator[tuple[TokenEvent, Cost | None]]:
        """One request's events; the last comes with the completion's cost.

        The request is checked and queued here, before this returns: a bad one raises now, not when
        the events are first read (a server can still answer it with an error status). ``until(event)``
        true ends the completion at that event (``stop``): the engine frees the sequence within one step.
        """
        ledger = self._ledger(request)
        start = time.perf_counter()
        stream = self._engine.stream([request], self.timeout)

        def events() -> Iterator[tuple[TokenEvent, Cost | None]]:
            try:
                for event in stream:
                    ended = _ended(event, until)
                    yield self._billed(ended, ledger, start)
                    if ended is not event:
                        return
            finally:
                stream.close()

        return events()

    async def _aopen_events(
        self, request: Request, until: Until | None = None
    ) -> AsyncIterator[tuple[TokenEvent, Cost | None]]:
        """:meth:`_stream_events` for async callers: the request is checked and queued (off the event loop) when
        this returns, so a bad one raises before any event; the events come with no thread per token, and a
        consumer that stops or is cancelled frees the engine within one step."""
        ledger = self._ledger(request)
        start = time.perf_counter()
        stream = await self._engine.asubmit([request], self.timeout)

        async def events() -> AsyncIterator[tuple[TokenEvent, Cost | None]]:
            try:
                async for event in stream:
                    ended = _ended(event, until)
                    yield self._billed(ended, ledger, start)
                    if ended is not event:
                        return
            finally:
                stream.close()

        return events()

    async def _astream_events(
        self, request: Request, until: Until | None = None
    ) -> AsyncIterator[tuple[TokenEvent, Cost | None]]:
        """The events of :meth:`_aopen_events`, as one async iterator (a bad request raises at the first item)."""
        events = await self._aopen_events(request, until)
        try:
            async for item in events:
                yield item
        finally:
            await events.aclose()  # type: ignore[attr-defined]


Until = Callable[[TokenEvent], bool]
"""Whether a completion should end at this event (a caller's own stop condition)."""


def _ended(event: TokenEvent, until: Until | None) -> TokenEvent:
    """``event``, made the last (``stop``) where ``until`` says the completion ends there."""
    if until is None or event.finish_reason is not None or not until(event):
        return event
    return dataclasses.replace(event, finish_reason=FinishReason.STOP)
