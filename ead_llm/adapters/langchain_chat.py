"""``ChatEntropyAdaptive``: the pair as a LangChain chat model over the shared engine (a thin adapter).

Messages become the prompt through the tokenizer's chat template, or a plain ``Role: text``
fallback when it has none (see :mod:`ead_llm.adapters.prompts`); on the embedded pair the default format is
``text`` (a single human message is passed through unchanged). Usage is on ``usage_metadata``; the
cost dict in ``response_metadata["cost"]``.

Tools (``bind_tools``) and structured output (``with_structured_output``) run on the engine's
grammar-constrained decoding (:mod:`ead_llm.core.grammar`, :mod:`ead_llm.adapters.tool_calls`): a
required or named tool, a JSON schema or JSON mode constrain every token, whichever model writes it.
Content other than text is refused.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LangSmithParams
from langchain_core.language_models.base import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableBinding
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict

from ead_llm.accounting.ledger import Cost, cache_hit_bill
from ead_llm.adapters.pair_model import CALL_OPTIONS, PairModel
from ead_llm.adapters.prompts import prompt_text, render
from ead_llm.adapters.structured import check_method, json_schema_of, structured, text_parser, tool_parser
from ead_llm.adapters.tool_calls import (
    NO_CALL,
    CallReader,
    InvalidCall,
    ToolCall,
    ToolPlan,
    check_tools,
    chosen_tools,
    finish_reason,
    plan_tools,
    read_answer,
)
from ead_llm.core.grammar import Constraint
from ead_llm.core.request import Completion, Prompt, Request
from ead_llm.core.types import TokenEvent
from ead_llm.policies.base import describe_policy


def _text(message: BaseMessage) -> str:
    """The text of a message; tool-call blocks in its content (Anthropic's ``tool_use``, LangChain's
    ``tool_call``) are skipped, since the message's ``tool_calls`` carry them."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif (
            isinstance(block, dict)
            and block.get("type") in ("tool_use", "tool_call")
            and isinstance(message, AIMessage)
        ):
            continue
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatEntropyAdaptive reads text only; got a {kind!r} content block")
    return "".join(parts)


def message_dicts(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as chat-format dicts: system, human, AI (with its tool calls), tool replies, or
    chat messages with those roles."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            out.append({"role": "system", "content": _text(message)})
        elif isinstance(message, HumanMessage):
            out.append({"role": "user", "content": _text(message)})
        elif isinstance(message, AIMessage):
            item: dict[str, Any] = {"role": "assistant", "content": _text(message)}
            if message.tool_calls:
                item["tool_calls"] = [
                    {"name": c["name"], "arguments": c["args"], "id": c.get("id")} for c in message.tool_calls
                ]
            out.append(item)
        elif isinstance(message, ToolMessage):
            out.append(
                {"role": "tool", "content": _text(message), "tool_call_id": message.tool_call_id, "name": message.name}
            )
        elif isinstance(message, ChatMessage) and message.role in ("system", "user", "assistant", "tool"):
            out.append({"role": message.role, "content": _text(message)})
        else:
            raise ValueError(
                f"ChatEntropyAdaptive takes system, human, AI and tool messages; got {type(message).__name__}"
            )
    return out


def _lc_call(call: ToolCall) -> Any:
    return tool_call(name=call.name, args=call.arguments, id=call.id)


def _lc_invalid(call: InvalidCall) -> Any:
    return invalid_tool_call(name=call.name, args=call.text, id=None, error=call.error)


def _lc_chunk(call: ToolCall, index: int) -> Any:
    return tool_call_chunk(name=call.name, args=json.dumps(call.arguments, ensure_ascii=False), id=call.id, index=index)


def _tool_spec(tool: Any) -> dict[str, Any]:
    """An OpenAI function spec of a LangChain tool, a function, a pydantic model, a TypedDict or a dict."""
    return convert_to_openai_tool(tool)


ToolChoice = Literal["auto", "none", "required", "any"] | str | dict[str, Any] | bool | None


def _usage(cost: Cost) -> UsageMetadata:
    """LangChain's usage; ``input_token_details.cache_read``: the prompt tokens the large model took from its
    prefix cache (counted in ``input_tokens`` too, as OpenAI's cached tokens are)."""
    usage = UsageMetadata(
        input_tokens=cost.prompt_tokens,
        output_tokens=cost.completion_tokens,
        total_tokens=cost.prompt_tokens + cost.completion_tokens,
    )
    if cost.large_cached_tokens:
        usage["input_token_details"] = InputTokenDetails(cache_read=cost.large_cached_tokens)
    return usage


def _zero_usage() -> UsageMetadata:
    return UsageMetadata(input_tokens=0, output_tokens=0, total_tokens=0)


class _BindsTools:
    """``bind_tools`` and ``with_structured_output``, the same for the model and for its bindings: each binds on
    top of the options it already has (a binding's settings and tools included)."""

    if TYPE_CHECKING:

        def bind(self, **kwargs: Any) -> BoundChat: ...

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: ToolChoice = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> BoundChat:
        """This model offering ``tools`` (LangChain tools, functions, pydantic models, TypedDicts or OpenAI
        specs). ``tool_choice``: ``auto`` (default: free text, calls parsed), ``none``, ``required``/``any``
        (one or more calls), or a tool's name (exactly that call); the last two are enforced by the grammar.
        ``parallel_tool_calls=False`` allows one call at most (OpenAI's meaning); a call repeated word for word
        in one answer counts once. ``response_format`` (OpenAI's, as ``create_agent``'s ``ProviderStrategy``
        binds it) makes the answer either calls or that JSON. ``strict`` is accepted for compatibility (calls
        are always valid under their schemas)."""
        specs = check_tools([_tool_spec(t) for t in tools])
        chosen_tools(specs, tool_choice)  # refuse a bad choice now, not at the first call
        bound: dict[str, Any] = {"tools": specs, **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**bound)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Answers parsed into ``schema`` (a pydantic class, a TypedDict, a JSON schema or an OpenAI tool
        spec). ``json_schema`` (default) constrains the answer to the schema; ``function_calling`` forces a
        call of a tool named after it; ``json_mode`` constrains it to any JSON object. An answer cut by
        ``max_tokens``, or without the call, raises ``OutputParserException`` (as langchain-openai refuses a
        ``finish_reason="length"`` answer); with ``include_raw`` the error is in ``parsing_error`` beside
        ``raw`` and ``parsed=None``. ``strict`` is accepted for compatibility (the grammar is always strict)."""
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        check_method(method)
        trace: dict[str, Any] = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, parallel_tool_calls=False, **trace)
            return structured(llm, tool_parser(schema, name), include_raw)
        if method == "json_schema":
            json_schema = {"schema": json_schema_of(schema), "strict": True}
            response_format: dict[str, Any] = {"type": "json_schema", "json_schema": json_schema}
        else:
            response_format = {"type": "json_object"}
        return structured(self.bind(response_format=response_format, **trace), text_parser(schema), include_raw)


class ChatEntropyAdaptive(_BindsTools, PairModel, BaseChatModel):
    """The pair as a LangChain chat model; the same settings and per-call overrides as ``EntropyAdaptiveLLM``."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    streaming: bool = False
    """Let ``invoke`` stream internally (callbacks then see every token)."""

    @property
    def _llm_type(self) -> str:
        return "entropy-adaptive-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._identity()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="ead-llm",
            ls_model_name=kwargs.get("model", self.model_name),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def _convert_cached_generations(self, cache_val: list[Any]) -> list[ChatGeneration]:
        """A LangChain cache hit: the stored message with a zero bill (``response_metadata["cost"]`` with
        ``cache_hit``, ``usage_metadata`` at zero), so that no way of summing the bill counts it twice."""
        out = []
        for generation in super()._convert_cached_generations(cache_val):
            message = generation.message
            if isinstance(message, AIMessage) and isinstance(message.response_metadata.get("cost"), dict):
                metadata = dict(message.response_metadata)
                metadata["cost"] = cache_hit_bill(metadata["cost"])
                metadata["token_usage"] = dict(_zero_usage())
                metadata["cache_hit"] = True
                update = {"response_metadata": metadata, "usage_metadata": _zero_usage()}
                generation = ChatGeneration(
                    message=message.model_copy(update=update), generation_info=generation.generation_info
                )
            out.append(generation)
        return out

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What LangChain may rely on: tools, a forced tool choice and structured output, all enforced by the
        grammar (so ``create_agent(response_format=Model)`` picks the provider strategy: one constrained answer)."""
        return ModelProfile(
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,
            text_inputs=True,
            text_outputs=True,
        )

    def bind(self, **kwargs: Any) -> BoundChat:  # type: ignore[override]
        """LangChain's ``bind``. Settings (``policy``, ``temperature``, ``max_tokens``, ``stop``, ...) become a copy
        of this model sharing its engine, so they hold whatever LangChain or LangGraph does with the binding
        (``bind_tools``, ``with_structured_output``, or unwrapping it to the model, as ``create_react_agent``
        does); a bad value is refused at the call, where callbacks see it. Other options (tools) stay bound."""
        return BoundChat(bound=self._with_settings(kwargs), kwargs=kwargs, config={})

    def _with_settings(self, kwargs: dict[str, Any]) -> ChatEntropyAdaptive:
        """This model with the settings among ``kwargs`` (popped) as its own; itself when there are none."""
        settings = {name: kwargs.pop(name) for name in (*CALL_OPTIONS, "stop") if name in kwargs}
        return self.model_copy(update=settings) if settings else self

    def _tools(self, kwargs: dict[str, Any]) -> ToolPlan:
        """Pops the tool options (and OpenAI's ``response_format``) from ``kwargs``; the plan's grammar becomes
        the call's ``grammar``."""
        answer = Constraint.response_format(kwargs.pop("response_format", None), bounds=self.json_bounds)
        plan = plan_tools(
            kwargs.pop("tools", None),
            kwargs.pop("tool_choice", None),
            kwargs.pop("parallel_tool_calls", None),
            answer=answer,
            bounds=self.json_bounds,
        )
        own = self._constraint(kwargs) is not None
        if own and plan.constraint is NO_CALL:  # the caller's own format is already no call
            return plan
        if plan.constraint is not None and own:
            raise ValueError("tools or a response_format already constrain the answer: drop json_schema/regex/grammar")
        if plan.constraint is not None:
            kwargs["grammar"] = plan.constraint
        return plan

    def _prompt(self, messages: list[BaseMessage], plan: ToolPlan | None = None) -> Prompt:
        tools, instruction = (plan.prompt_tools, plan.instruction()) if plan is not None else (None, None)
        return render(
            self.shared_engine.tokenizer, message_dicts(messages), self.resolved_prompt_format, tools, instruction
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._call(messages, stop, kwargs)
        if call.until is not None:  # tools offered: read the calls as they come, and end the answer at a repeat
            for event, cost in self._stream_events(call.request, call.until):
                call.take(event, cost)
            return call.taken()
        (completion,), total = self._run([call.request])
        return call.result(completion, total)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Awaits the engine itself: cancelling the task stops the decoding within one engine step."""
        call = self._call(messages, stop, kwargs)
        if call.until is not None:
            async for event, cost in self._astream_events(call.request, call.until):
                call.take(event, cost)
            return call.taken()
        (completion,), total = await self._arun([call.request])
        return call.result(completion, total)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._call(messages, stop, kwargs)
        for event, cost in self._stream_events(call.request, call.until):
            chunk = call.chunk(event, cost)
            if run_manager is not None:
                run_manager.on_llm_new_token(event.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = self._call(messages, stop, kwargs)
        async for event, cost in self._astream_events(call.request, call.until):
            chunk = call.chunk(event, cost)
            if run_manager is not None:
                await run_manager.on_llm_new_token(event.text, chunk=chunk)
            yield chunk

    def _call(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _ChatCall:
        plan = self._tools(kwargs)
        prompt = self._prompt(messages, plan)
        (request,) = self._requests([prompt], stop, kwargs)
        return _ChatCall(self, request, plan, prompt_text(self.shared_engine.tokenizer, prompt))


class BoundChat(_BindsTools, RunnableBinding):
    """``chat.bind(...)``: LangChain's binding of a model whose bound settings are its own (see
    :meth:`ChatEntropyAdaptive.bind`); ``bind_tools`` and ``with_structured_output`` keep the bound options."""

    def bind(self, **kwargs: Any) -> BoundChat:
        """More options on top of these (settings into a copy of the model, the rest bound)."""
        model = self.bound
        bound = model._with_settings(kwargs) if isinstance(model, ChatEntropyAdaptive) else model
        return type(self)(
            bound=bound,
            kwargs={**self.kwargs, **kwargs},
            config=self.config,
            config_factories=self.config_factories,
            custom_input_type=self.custom_input_type,
            custom_output_type=self.custom_output_type,
        )


class _ChatCall:
    """One chat call: its engine request and how its text becomes a message (tool calls read out), whole or
    streamed chunk by chunk."""

    def __init__(self, model: ChatEntropyAdaptive, request: Request, plan: ToolPlan, prefix: str) -> None:
        self.model, self.request, self.plan, self.prefix = model, request, plan, prefix
        self._reader: CallReader | None = plan.reader()
        self.until = None if request.policy.votes else plan.until()
        """Where the answer ends early (a repeated call), read as it comes; None: a policy that cannot stream."""
        self._made = 0
        self._text: list[str] = []
        self._models: list[str] = []
        self._end: tuple[str, Cost] | None = None

    def _metadata(self, cost: Cost, finish: str, models: str) -> dict[str, Any]:
        """What an invoked message and a stream's last chunk both carry."""
        return {
            "finish_reason": finish,
            "model_name": self.model.model_name,
            "model_provider": "ead-llm",
            "policy": describe_policy(self.request.policy),
            "token_usage": dict(_usage(cost)),
            "cost": cost.to_dict(),
            "models": models,
        }

    def take(self, event: TokenEvent, cost: Cost | None) -> None:
        """Keep one event of an answer read as it comes (the last brings the bill)."""
        self._text.append(event.text)
        self._models.append(event.role.letter)
        if event.finish_reason is not None and cost is not None:
            self._end = (event.finish_reason.value, cost)

    def taken(self) -> ChatResult:
        """The result of the answer whose events were taken."""
        if self._end is None:
            raise RuntimeError("the answer ended without its last event")
        return self.message("".join(self._text), self._end[0], "".join(self._models), self._end[1])

    def result(self, completion: Completion, cost: Cost) -> ChatResult:
        return self.message(
            completion.text, completion.finish_reason.value, "".join(r.letter for r in completion.roles), cost
        )

    def message(self, text: str, engine_finish: str, models: str, cost: Cost) -> ChatResult:
        """The chat result of an answer: its text, why it ended, which model wrote each token, its bill."""
        model = self.model
        content, calls, invalid = text, list[ToolCall](), list[InvalidCall]()
        if self.plan.mode != "none":
            content, calls, invalid = read_answer(
                model.shared_engine.tokenizer,
                text,
                engine_finish,
                prefix=self.prefix,
                tools=self.plan.tools,
                parallel=self.plan.parallel,
            )
        finish = finish_reason(engine_finish, len(calls))
        metadata = self._metadata(cost, finish, models)
        message = AIMessage(
            content=content,
            tool_calls=[_lc_call(c) for c in calls],
            invalid_tool_calls=[_lc_invalid(c) for c in invalid],
            usage_metadata=_usage(cost),
            response_metadata=metadata,
        )
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info={"finish_reason": finish})],
            llm_output={"token_usage": dict(_usage(cost)), "cost": cost.to_dict(), "model_name": model.model_name},
        )

    def chunk(self, event: TokenEvent, cost: Cost | None) -> ChatGenerationChunk:
        """The message chunk of one streamed token; the last carries what an invoked message carries."""
        engine_finish = event.finish_reason.value if cost is not None and event.finish_reason is not None else None
        reader = self._reader
        text, calls, invalid = (event.text, [], []) if reader is None else reader.push(event.text, engine_finish)
        chunks = [_lc_chunk(c, self._made + i) for i, c in enumerate(calls)]
        self._made += len(calls)
        if engine_finish is None:
            metadata = {"models": event.role.letter}
            return ChatGenerationChunk(
                message=AIMessageChunk(content=text, tool_call_chunks=chunks, response_metadata=metadata)
            )
        assert cost is not None
        message = AIMessageChunk(
            content=text,
            tool_call_chunks=chunks,
            invalid_tool_calls=[_lc_invalid(c) for c in invalid],
            usage_metadata=_usage(cost),
            response_metadata=self._metadata(cost, finish_reason(engine_finish, self._made), event.role.letter),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)
