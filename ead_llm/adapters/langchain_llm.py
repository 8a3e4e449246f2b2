"""``EntropyAdaptiveLLM``: the pair as a LangChain LLM and a DSPy LM at once, over the shared engine.

DSPy side: the object is a ``dspy.LM`` on DSPy 3.4's custom-engine route (``engine=PairEngine``,
``async_engine=AsyncPairEngine``). ``dspy.LM.__init__`` is not called, because it would overwrite
LangChain's ``cache`` and ``callbacks``; the DSPy state it would set is declared here instead.
How the two frameworks' overlapping names are resolved:

- ``cache``: LangChain's field (a ``BaseCache``, True, False or None). DSPy calls use DSPy's
  cache unless ``cache`` is False.
- ``callbacks``: LangChain's handlers. DSPy callbacks are the ones registered with
  ``dspy.configure(callbacks=[...])``; they see ``on_lm_start``/``on_lm_end`` for every call.
- ``copy(**kwargs)``: DSPy's meaning (``copy(rollout_id=1, temperature=1.0)``): a new object with
  those settings, its own history, the same engine. Pydantic's deprecated ``copy`` is replaced;
  ``model_copy`` is still pydantic's.
- ``engine``: DSPy's meaning (its engine object); the decoding engine is ``shared_engine``.
- ``model``: DSPy's name of this LM (its usage key), ``ead-llm/<large model's name>``; the pair and the
  policy ride in each request's ``metadata``, which is part of DSPy's cache key, so two policies never
  share cached answers.
- ``copy.deepcopy`` (DSPy's ``Module.deepcopy``, LangChain chains) makes a ``copy()``: the weights
  are never cloned. Equality and hashing are by identity.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Literal

import dspy
from dspy.clients.base_lm import LM_CLASS_STATE_KEY, BaseLM
from dspy.clients.provider import Provider
from dspy.utils.callback_context import ACTIVE_CALL_ID
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
from langchain_core.language_models import LangSmithParams
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import ContextThreadPoolExecutor, get_config_list
from pydantic import ConfigDict, PrivateAttr

from ead_llm.accounting.ledger import Cost, Pricing, cache_hit_bill
from ead_llm.adapters.dspy_engine import AsyncPairEngine, PairEngine, answered_from_cache, candidate_scope
from ead_llm.adapters.pair_model import CALL_OPTIONS, LOAD_FIELDS, PairModel
from ead_llm.adapters.structured import check_method, json_schema_of, structured, text_parser
from ead_llm.core.grammar import Constraint
from ead_llm.core.request import Completion, Request
from ead_llm.core.types import Role, TokenEvent
from ead_llm.policies.base import Policy, check_policy, describe_policy, policy_from_description, policy_tag

logger = logging.getLogger(__name__)

DSPY_OWN_OPTIONS = ("policy", "ignore_eos", "prompt_truncation")
"""Per-call options DSPy's canonical request has no place for; the LM takes them itself."""
_DSPY_CALL = BaseLM.__call__.__wrapped__
_DSPY_ACALL = BaseLM.acall.__wrapped__
_STATE_FIELDS = (
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
    "timeout",
    "max_retries",
    "max_batch",
    "kv_budget_tokens",
    "prompt_format",
    "enforce_adapter_format",
    *LOAD_FIELDS,
)


class _DSPyKwargs(dict[str, Any]):
    """``lm.kwargs`` as DSPy reads it: the sampling fields plus extra request keys (``rollout_id``).

    A fresh view on each read; writes go back to the LM (a field, or an extra key).
    """

    def __init__(self, owner: EntropyAdaptiveLLM) -> None:
        super().__init__(owner._dspy_request_defaults())
        self._owner = owner

    def __setitem__(self, key: str, value: Any) -> None:
        self._owner._set_dspy_kwarg(key, value)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._owner._set_dspy_kwarg(key, None)
        super().__delitem__(key)


class EntropyAdaptiveLLM(PairModel, BaseLLM, dspy.LM):
    """A small and a large causal LM behaving as one LLM, the large one spent where text is hard.

    With no ``small``/``large`` it runs the embedded default pair offline. Every sampling setting and
    the policy can be overridden per call (``llm.invoke(x, policy=SmallOnly())``, ``llm.bind(...)``,
    or in DSPy ``lm.copy(policy=...)``). Each completion's cost dict is in
    ``generation_info["cost"]``; the call's sum in ``llm_output["cost"]`` beside
    ``llm_output["token_usage"]``; in DSPy, in ``lm.history[i]["ead_cost"]``.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    enforce_adapter_format: bool = True
    """DSPy: decode an answer to DSPy's ``ChatAdapter`` under a grammar of the format it asked for (its field
    markers in order, typed values, free text bounded), so it always parses; chat-format pairs only, and not
    with ``ignore_eos`` (which writes past any format's end)."""

    # DSPy's LM state (what dspy.LM.__init__ would set), declared so pydantic accepts it.
    _history: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _dspy_extra: dict[str, Any] = PrivateAttr(default_factory=dict)
    _engine_store: dict[Any, Any] = PrivateAttr(default_factory=dict)
    _engine_lock: Any = PrivateAttr(default_factory=threading.RLock)
    _providers: tuple[Any, ...] = PrivateAttr(default=())
    _warned_zero_temp_rollout: bool = PrivateAttr(default=False)
    num_retries: ClassVar[int] = 0  # the engine retries out-of-memory failures itself (max_retries)
    provider: ClassVar[Provider] = Provider()
    use_developer_role: ClassVar[bool] = False

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    # -- DSPy's view ------------------------------------------------------------------------------

    @property
    def model(self) -> str:
        """DSPy's name of this LM (its usage key): ``ead-llm/`` and the large model's name. The pair and the
        policy, which also decide the output, ride in the request's ``metadata`` (:meth:`dspy_metadata`), so
        DSPy's cache never hands one policy's answer to another."""
        return self.model_name

    def dspy_metadata(self) -> dict[str, str]:
        """OpenAI's ``metadata`` of this LM's DSPy requests: the pair as given and the policy (part of DSPy's
        cache key; they never change how a request decodes)."""
        policy = self.policy  # a per-call option not yet checked may be anything: the run will refuse it
        tag = policy_tag(policy) if isinstance(policy, Policy) else repr(policy)
        flags = (",ignore_eos" if self.ignore_eos else "") + ("" if self.enforce_adapter_format else ",free_format")
        return {"ead_llm_pair": self.pair_name, "ead_llm_policy": tag + flags}

    @property
    def model_type(self) -> Literal["chat", "text"]:
        """``chat`` (chat template) or ``text`` (raw completion prompt): see ``prompt_format``."""
        return self.resolved_prompt_format

    @property
    def history(self) -> list[dict[str, Any]]:
        """DSPy's call history of this object."""
        return self._history

    @history.setter
    def history(self, value: list[dict[str, Any]]) -> None:
        self._history = value

    @property
    def kwargs(self) -> dict[str, Any]:
        """DSPy's default request parameters: the sampling fields, plus extra keys such as ``rollout_id``."""
        return _DSPyKwargs(self)

    @kwargs.setter
    def kwargs(self, value: dict[str, Any]) -> None:
        self._dspy_extra = {}
        for key, item in value.items():
            self._set_dspy_kwarg(key, item)

    def _dspy_request_defaults(self) -> dict[str, Any]:
        defaults: dict[str, Any] = {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        if self.top_k:
            defaults["top_k"] = self.top_k
        if self.stop:
            defaults["stop"] = list(self.stop)
        extra = dict(self._dspy_extra)
        metadata = {**(extra.pop("metadata", None) or {}), **self.dspy_metadata()}
        return {**{k: v for k, v in defaults.items() if v is not None}, **extra, "metadata": metadata}

    def _set_dspy_kwarg(self, key: str, value: Any) -> None:
        if key in ("temperature", "max_tokens", "top_p", "top_k", "seed", "stop"):
            self._sampling({key: value}, value if key == "stop" else None)  # validates
            setattr(self, key, value)
        elif value is None:
            self._dspy_extra.pop(key, None)
        else:
            self._dspy_extra[key] = value

    @property
    def _engine_spec(self) -> PairEngine:
        return PairEngine(self)

    @property
    def _async_engine_spec(self) -> AsyncPairEngine:
        return AsyncPairEngine(PairEngine(self))

    @property
    def supports_function_calling(self) -> bool:
        return False

    @property
    def supports_reasoning(self) -> bool:
        return False

    @property
    def supports_response_schema(self) -> bool:
        """DSPy's JSONAdapter then asks for a JSON schema, which the grammar enforces."""
        return True

    def _dspy_cache(self) -> bool:
        return self.cache is not False

    def __call__(self, prompt: Any = None, *, messages: Any = None, **kwargs: Any) -> Any:
        """DSPy call: ``lm("text")`` / ``lm(messages=[...])`` return a list of outputs. ead-llm's own per-call
        options (``policy=``, ``ignore_eos=``, ``prompt_truncation=``) are taken here, before DSPy builds its
        canonical request, by calling a copy that shares this object's history."""
        own = {k: kwargs.pop(k) for k in DSPY_OWN_OPTIONS if k in kwargs}
        if own:
            return self._dspy_bound(own)(prompt, messages=messages, **kwargs)
        kwargs.setdefault("cache", self._dspy_cache())
        inputs = {"prompt": prompt, "messages": messages, "kwargs": dict(kwargs)}
        with _dspy_callbacks(self, inputs) as finish, candidate_scope(self._rollout(kwargs)):
            return finish(_DSPY_CALL(self, prompt, messages=messages, **kwargs))

    async def acall(self, prompt: Any = None, *, messages: Any = None, **kwargs: Any) -> Any:
        """Async DSPy call."""
        own = {k: kwargs.pop(k) for k in DSPY_OWN_OPTIONS if k in kwargs}
        if own:
            return await self._dspy_bound(own).acall(prompt, messages=messages, **kwargs)
        kwargs.setdefault("cache", self._dspy_cache())
        inputs = {"prompt": prompt, "messages": messages, "kwargs": dict(kwargs)}
        with _dspy_callbacks(self, inputs) as finish, candidate_scope(self._rollout(kwargs)):
            return finish(await _DSPY_ACALL(self, prompt, messages=messages, **kwargs))

    def _dspy_bound(self, options: dict[str, Any]) -> EntropyAdaptiveLLM:
        """A copy with per-call options as its settings (``model``, DSPy's cache key, names the policy),
        recording into this object's history."""
        if "policy" in options:
            check_policy(options["policy"])
        bound = self.copy(**options)
        bound._history = self._history
        return bound

    def _rollout(self, kwargs: dict[str, Any]) -> Any:
        """DSPy's ``rollout_id`` of this call (``lm.copy(rollout_id=k)``, or passed per call): BestOfN, Refine
        and BootstrapFewShot ask for distinct samples with it, so it picks the call's random streams."""
        return kwargs.get("rollout_id", self._dspy_extra.get("rollout_id"))

    def copy(self, **kwargs: Any) -> EntropyAdaptiveLLM:
        """DSPy's copy: a new LM with updated settings, its own history, sharing the engine.

        Field names (``temperature``, ``policy``, ...) set fields; other keys (``rollout_id``) become
        DSPy request parameters, None removing one.
        """
        if "engine" in kwargs or "async_engine" in kwargs:
            raise ValueError("an EntropyAdaptiveLLM's engine is its pair: copy(small=..., large=...) to change it")
        if "model" in kwargs:
            raise ValueError("model is derived from the pair and policy: copy(small=..., large=..., policy=...)")
        names = set(type(self).model_fields)
        updates = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        current = {k: getattr(self, k) for k in self.model_fields_set | {"policy"} if k in names}
        copied = type(self)(**{**current, **updates})
        copied._dspy_extra = dict(self._dspy_extra)
        for key, value in kwargs.items():
            copied._set_dspy_kwarg(key, value)
        return copied

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> EntropyAdaptiveLLM:
        """A ``copy()``: same engine and weights, own history."""
        return self.copy()

    def __getstate__(self) -> dict[Any, Any]:
        """Pickle without DSPy's lock and engine pools (the engine pickles as its load settings)."""
        state = super().__getstate__()
        private = dict(state.get("__pydantic_private__") or {})
        private.pop("_engine_lock", None)
        private.pop("_engine_store", None)
        return {**state, "__pydantic_private__": private}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        self._engine_lock = threading.RLock()
        self._engine_store = {}

    def update_history(self, entry: dict[str, Any]) -> None:
        """Add the call's cost dict as ``entry["ead_cost"]`` (and USD as DSPy's ``cost``) before recording; a
        cache hit's is a zero bill with ``cache_hit`` (as DSPy's own ``usage`` is empty then), and the stored
        answer's own bill is kept as ``entry["ead_stored_cost"]`` (what it would cost to compute, which
        :class:`~ead_llm.optimize.PolicyOptimizer` prices a configuration by)."""
        responses = entry.get("response")
        costs = []
        for response in responses if isinstance(responses, (list, tuple)) else [responses]:
            data = getattr(response, "provider_data", None)
            if isinstance(data, dict) and "cost" in data:
                costs.append(
                    Cost.from_dict(data["cost"], small_params=data["small_params"], large_params=data["large_params"])
                )
        if costs:
            total = Cost.total(costs, wall_time_s=sum(c.wall_time_s for c in costs)).to_dict()
            if answered_from_cache():  # DSPy's stored response: its work is not done, nor billed, again
                entry["ead_stored_cost"] = total
                total = cache_hit_bill(total)
            entry["ead_cost"] = total
            if entry.get("cost") is None and "cost_usd" in total:
                entry["cost"] = total["cost_usd"]
        super().update_history(entry)

    def dump_state(self) -> dict[str, Any]:
        """JSON state for DSPy's ``save``: the settings and the policy (never the weights)."""
        state: dict[str, Any] = {
            LM_CLASS_STATE_KEY: f"{type(self).__module__}.{type(self).__qualname__}",
            **{name: getattr(self, name) for name in _STATE_FIELDS},
            "policy": describe_policy(self._policy()),
            "pricing": None if self.pricing is None else vars(self.pricing),
        }
        if self._dspy_extra:
            state["dspy_kwargs"] = dict(self._dspy_extra)
        return state

    @classmethod
    def load_state(cls, state: dict[str, Any], *, allow_custom_lm_class: bool = False) -> EntropyAdaptiveLLM:
        """Rebuild from :meth:`dump_state` (loads the pair through the shared-engine registry)."""
        state = {k: v for k, v in state.items() if k != LM_CLASS_STATE_KEY}
        extra = state.pop("dspy_kwargs", {})
        if isinstance(state.get("policy"), dict):
            state["policy"] = policy_from_description(state["policy"])
        if isinstance(state.get("pricing"), dict):
            state["pricing"] = Pricing(**state["pricing"])
        llm = cls(**state)
        for key, value in extra.items():
            llm._set_dspy_kwarg(key, value)
        return llm

    # -- LangChain's view -------------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "entropy-adaptive"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._identity()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "ead-llm"
        params["ls_model_name"] = self.model_name
        return params

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        """Tool calling needs messages: use ``ChatEntropyAdaptive`` (same engine, same settings)."""
        raise NotImplementedError(
            "EntropyAdaptiveLLM is a completion model and takes no tools: use ChatEntropyAdaptive(...).bind_tools(...) "
            "(the same pair and engine), or constrain the text with json_schema=/regex=/grammar="
        )

    def with_structured_output(
        self, schema: dict[str, Any] | type, *, method: str = "json_schema", include_raw: bool = False, **kwargs: Any
    ) -> Any:
        """Completions constrained to ``schema`` (a pydantic class, TypedDict or JSON schema; ``json_mode``:
        any JSON object) and parsed into it. ``include_raw`` returns ``{"raw", "parsed", "parsing_error"}``."""
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        check_method(method, ("json_schema", "json_mode"))
        bound = (
            self.bind(json_schema=json_schema_of(schema))
            if method == "json_schema"
            else self.bind(grammar=Constraint.json_object())
        )
        return structured(bound, text_parser(schema), include_raw)

    def _bound(self, options: dict[str, Any]) -> EntropyAdaptiveLLM:
        """This object with per-call options applied (so LangChain's cache key sees them). Nothing is
        checked here: a bad option raises inside the run, where callbacks see it (``on_llm_error``)."""
        bound = self.model_copy(update=options)
        bound._history = self._history
        return bound

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        """LangChain's batch. Without ``return_exceptions`` it is one engine call (any failure raises). With it,
        each input is a run of its own (its own callbacks, its own error): the runs are submitted at once and
        the engine decodes them together, so one failing input leaves the others' texts as they are alone."""
        if not return_exceptions or not inputs:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        configs = get_config_list(config, len(inputs))
        workers = min(len(inputs), configs[0].get("max_concurrency") or self.shared_engine.max_batch)

        def run(item: Any, item_config: RunnableConfig) -> Any:
            try:
                return self.invoke(item, item_config, **kwargs)
            except Exception as exc:
                return exc

        # each run in a copy of the caller's context, as LangChain's own batch does: track_cost() blocks and
        # tracing see the runs
        with ContextThreadPoolExecutor(max_workers=workers, thread_name_prefix="ead-llm-batch") as pool:
            return list(pool.map(run, inputs, configs))

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        """Async batch, with the same per-input runs under ``return_exceptions``."""
        if not return_exceptions or not inputs:
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        configs = get_config_list(config, len(inputs))
        limit = asyncio.Semaphore(configs[0].get("max_concurrency") or len(inputs))

        async def run(item: Any, item_config: RunnableConfig) -> Any:
            async with limit:
                try:
                    return await self.ainvoke(item, item_config, **kwargs)
                except Exception as exc:
                    return exc

        return list(await asyncio.gather(*(run(i, c) for i, c in zip(inputs, configs, strict=True))))

    def generate(  # type: ignore[override]
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks = None, **kwargs: Any
    ) -> LLMResult:
        """LangChain's generate; per-call options (``policy=...``) take part in the cache key."""
        options = {k: kwargs.pop(k) for k in CALL_OPTIONS if k in kwargs}
        if options:
            return self._bound(options).generate(prompts, stop, callbacks, **kwargs)
        fresh: set[int] = set()
        token = _FRESH.set(fresh)
        try:
            return _cache_hits_zeroed(super().generate(prompts, stop, callbacks, **kwargs), fresh)
        finally:
            _FRESH.reset(token)

    async def agenerate(  # type: ignore[override]
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks = None, **kwargs: Any
    ) -> LLMResult:
        """Async generate, with the same handling of per-call options."""
        options = {k: kwargs.pop(k) for k in CALL_OPTIONS if k in kwargs}
        if options:
            return await self._bound(options).agenerate(prompts, stop, callbacks, **kwargs)
        fresh: set[int] = set()
        token = _FRESH.set(fresh)
        try:
            return _cache_hits_zeroed(await super().agenerate(prompts, stop, callbacks, **kwargs), fresh)
        finally:
            _FRESH.reset(token)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        requests = self._requests(prompts, stop, kwargs)
        return self._result(requests, *self._run(requests))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """Awaits the engine itself: cancelling the task (``asyncio.wait_for``, a client that left) stops the
        decoding within one engine step."""
        requests = self._requests(prompts, stop, kwargs)
        return self._result(requests, *await self._arun(requests))

    def _result(self, requests: list[Request], completions: list[Completion], total: Cost) -> LLMResult:
        generations = [[Generation(text=c.text, generation_info=_generation_info(c))] for c in completions]
        fresh = _FRESH.get()
        if fresh is not None:
            fresh.update(id(g) for row in generations for g in row)
        return PairResult(
            generations=generations,
            llm_output={
                "token_usage": {
                    "prompt_tokens": total.prompt_tokens,
                    "completion_tokens": total.completion_tokens,
                    "total_tokens": total.prompt_tokens + total.completion_tokens,
                },
                "cost": total.to_dict(),
                "model_name": self.model_name,
                "policy": describe_policy(requests[0].policy if requests else self._policy()),
            },
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        (request,) = self._requests([prompt], stop, kwargs)
        if run_manager is not None:
            _report_on_end(run_manager, self)
        for event, cost in self._stream_events(request):
            chunk = _chunk(event, cost)
            if run_manager is not None:
                run_manager.on_llm_new_token(event.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        (request,) = self._requests([prompt], stop, kwargs)
        if run_manager is not None:
            _report_on_end(run_manager, self)
        async for event, cost in self._astream_events(request):
            chunk = _chunk(event, cost)
            if run_manager is not None:
                await run_manager.on_llm_new_token(event.text, chunk=chunk)
            yield chunk


def _chunk(event: TokenEvent, cost: Cost | None) -> GenerationChunk:
    """One streamed token; the last carries the finish reason and the cost."""
    info = _chunk_info(event.role, event.token_id, event.entropy)
    if cost is not None and event.finish_reason is not None:
        info.update(finish_reason=event.finish_reason.value, cost=cost.to_dict())
    return GenerationChunk(text=event.text, generation_info=info)


class PairResult(LLMResult):
    """An ``LLMResult`` whose ``flatten()`` gives each prompt its own bill: LangChain reports a batch to
    callbacks as one ``on_llm_end`` per prompt, and their costs must add up to the call's."""

    def flatten(self) -> list[LLMResult]:
        out = []
        for generations in self.generations:
            info = generations[0].generation_info or {} if generations else {}
            out.append(LLMResult(generations=[generations], llm_output={**(self.llm_output or {}), **_bill(info)}))
        return out


_FRESH: ContextVar[set[int] | None] = ContextVar("ead_llm_fresh_generations", default=None)
"""Ids of the generations the engine made during the ``generate`` call in progress (the rest came from a cache)."""


def _cache_hits_zeroed(result: LLMResult, fresh: set[int]) -> LLMResult:
    """``result`` with each generation LangChain's cache returned given a zero bill marked ``cache_hit`` (a copy:
    the cached object is left as stored), so that summing ``generation_info["cost"]`` never counts it twice."""
    for row in result.generations:
        for i, generation in enumerate(row):
            info = generation.generation_info or {}
            if id(generation) in fresh or not isinstance(info.get("cost"), dict):
                continue
            row[i] = Generation(text=generation.text, generation_info={**info, "cost": cache_hit_bill(info["cost"])})
    return result


def _bill(info: dict[str, Any]) -> dict[str, Any]:
    """``llm_output``'s usage keys for one completion's ``generation_info``."""
    cost = info.get("cost")
    if cost is None:
        return {}
    usage = {key: cost[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"token_usage": usage, "cost": cost}


def _report_on_end(run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun, llm: Any) -> None:
    """Make the ``on_llm_end`` LangChain sends after a stream carry ``llm_output`` (the bill and token
    usage), as a non-streamed call's does: the streamed generation's info holds the cost."""
    original = run_manager.on_llm_end

    def on_llm_end(response: LLMResult, **kwargs: Any) -> Any:
        if response.llm_output is None and response.generations and response.generations[0]:
            info = response.generations[0][0].generation_info or {}
            output = {**_bill(info), "model_name": llm.model_name, "policy": describe_policy(llm._policy())}
            response = LLMResult(generations=response.generations, llm_output=output, run=response.run)
        return original(response, **kwargs)

    run_manager.on_llm_end = on_llm_end  # type: ignore[method-assign]


def _chunk_info(role: Role, token_id: int, entropy: float) -> dict[str, Any]:
    """Lists and strings, so that LangChain's chunk merging concatenates them."""
    return {"models": role.letter, "token_ids": [token_id], "entropies": [entropy]}


def _generation_info(completion: Completion) -> dict[str, Any]:
    """``models`` has one letter per token: S (small) or L (large); EAGER adds its vote."""
    info: dict[str, Any] = {
        "finish_reason": completion.finish_reason.value,
        "cost": completion.cost.to_dict(),
        "models": "".join(r.letter for r in completion.roles),
        "token_ids": list(completion.token_ids),
        "entropies": list(completion.entropies),
    }
    if completion.votes is not None:
        branches = completion.cost.extra.get("branches", 0)
        info.update(votes=completion.votes, paths=completion.paths, branches=branches, chosen_path=completion.path)
    return info


@contextmanager
def _dspy_callbacks(lm: EntropyAdaptiveLLM, inputs: dict[str, Any]) -> Iterator[Callable[[Any], Any]]:
    """DSPy's ``on_lm_start``/``on_lm_end`` for the callbacks in ``dspy.settings.callbacks``.

    (DSPy's own decorator also reads ``lm.callbacks``, which on this object are LangChain's.)
    """
    callbacks = list(dspy.settings.get("callbacks", None) or [])
    if not callbacks:
        yield lambda outputs: outputs
        return
    call_id = uuid.uuid4().hex
    for callback in callbacks:
        try:
            callback.on_lm_start(call_id=call_id, instance=lm, inputs=inputs)
        except Exception as exc:  # a failing callback must not fail the call (DSPy's rule)
            logger.warning("DSPy callback %r failed on_lm_start: %s", callback, exc)
    token = ACTIVE_CALL_ID.set(call_id)
    result: dict[str, Any] = {"outputs": None}

    def finish(outputs: Any) -> Any:
        result["outputs"] = outputs
        return outputs

    error: BaseException | None = None
    try:
        yield finish
    except BaseException as exc:
        error = exc
        raise
    finally:
        ACTIVE_CALL_ID.reset(token)
        for callback in callbacks:
            try:
                callback.on_lm_end(call_id=call_id, outputs=result["outputs"], exception=error)
            except Exception as exc:
                logger.warning("DSPy callback %r failed on_lm_end: %s", callback, exc)
