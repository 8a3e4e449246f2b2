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
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LangSmithParams
from langchain_core.language_models.base import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict

from ead_llm.accounting.ledger import Cost
from ead_llm.adapters.pair_model import PairModel
from ead_llm.adapters.prompts import prompt_text, render
from ead_llm.adapters.structured import check_method, is_pydantic, json_schema_of, structured, text_parser
from ead_llm.adapters.tool_calls import CallSplitter, ToolCall, check_tools, chosen_tools, plan_tools, split_calls
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


def _lc_chunk(call: ToolCall, index: int) -> Any:
    return tool_call_chunk(name=call.name, args=json.dumps(call.arguments, ensure_ascii=False), id=call.id, index=index)


def _tool_spec(tool: Any) -> dict[str, Any]:
    """An OpenAI function spec of a LangChain tool, a function, a pydantic model, a TypedDict or a dict."""
    return convert_to_openai_tool(tool)


ToolChoice = Literal["auto", "none", "required", "any"] | str | dict[str, Any] | bool | None


def _usage(cost: Cost) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=cost.prompt_tokens,
        output_tokens=cost.completion_tokens,
        total_tokens=cost.prompt_tokens + cost.completion_tokens,
    )


class ChatEntropyAdaptive(PairModel, BaseChatModel):
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
            ls_model_name=kwargs.get("model", self.pair_name),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: ToolChoice = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model offering ``tools`` (LangChain tools, functions, pydantic models, TypedDicts or OpenAI
        specs). ``tool_choice``: ``auto`` (default: free text, calls parsed), ``none``, ``required``/``any``
        (one or more calls), or a tool's name (exactly that call); the last two are enforced by the grammar.
        ``parallel_tool_calls=False`` allows one call at most."""
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
        call of a tool named after it; ``json_mode`` constrains it to any JSON object. ``include_raw``
        returns ``{"raw", "parsed", "parsing_error"}``. ``strict`` is accepted for compatibility (the
        grammar is always strict)."""
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        check_method(method)
        trace = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
        llm: Runnable
        parser: Runnable
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, parallel_tool_calls=False, **trace)
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic(schema)
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method == "json_schema":
            llm, parser = self.bind(json_schema=json_schema_of(schema), **trace), text_parser(schema)
        else:
            llm, parser = self.bind(grammar=Constraint.json_object(), **trace), text_parser(schema)
        return structured(llm, parser, include_raw)

    def _tools(self, kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], str, Constraint | None]:
        """Pops the tool options from ``kwargs``: the tools offered, the mode, and the grammar it imposes
        (which becomes the call's ``grammar``)."""
        offered, mode, constraint = plan_tools(
            kwargs.pop("tools", None), kwargs.pop("tool_choice", None), kwargs.pop("parallel_tool_calls", None)
        )
        if constraint is not None and any(kwargs.get(name) is not None for name in ("json_schema", "regex", "grammar")):
            raise ValueError("a required or named tool already constrains the answer: drop json_schema/regex/grammar")
        if constraint is not None:
            kwargs["grammar"] = constraint
        return offered, mode, constraint

    def _prompt(self, messages: list[BaseMessage], tools: list[dict[str, Any]] | None = None) -> Prompt:
        return render(self.shared_engine.tokenizer, message_dicts(messages), self.resolved_prompt_format, tools)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._call(messages, stop, kwargs)
        (completion,), cost = self._run([call.request])
        return call.result(completion, cost)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Awaits the engine itself: cancelling the task stops the decoding within one engine step."""
        call = self._call(messages, stop, kwargs)
        (completion,), cost = await self._arun([call.request])
        return call.result(completion, cost)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._call(messages, stop, kwargs)
        for event, cost in self._stream_events(call.request):
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
        async for event, cost in self._astream_events(call.request):
            chunk = call.chunk(event, cost)
            if run_manager is not None:
                await run_manager.on_llm_new_token(event.text, chunk=chunk)
            yield chunk

    def _call(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _ChatCall:
        tools, mode, _ = self._tools(kwargs)
        prompt = self._prompt(messages, tools)
        (request,) = self._requests([prompt], stop, kwargs)
        return _ChatCall(self, request, tools, mode, prompt_text(self.shared_engine.tokenizer, prompt))


class _ChatCall:
    """One chat call: its engine request and how its text becomes a message (tool calls split out), whole or
    streamed chunk by chunk."""

    def __init__(
        self, model: ChatEntropyAdaptive, request: Request, tools: list[dict[str, Any]], mode: str, salt: str
    ) -> None:
        self.model, self.request, self.tools, self.mode, self.salt = model, request, tools, mode, salt
        self._splitter = CallSplitter(salt=salt) if mode != "none" else None
        self._made = 0

    def result(self, completion: Completion, cost: Cost) -> ChatResult:
        model = self.model
        content, calls, invalid = completion.text, list[ToolCall](), list[str]()
        if self.mode != "none":
            tokenizer = model.shared_engine.tokenizer
            content, calls, invalid = split_calls(tokenizer, completion.text, self.salt, self.tools, self.salt)
        metadata = {
            "finish_reason": "tool_calls" if calls else completion.finish_reason.value,
            "model_name": model.pair_name,
            "cost": cost.to_dict(),
            "models": "".join(r.letter for r in completion.roles),
            "policy": describe_policy(self.request.policy),
        }
        message = AIMessage(
            content=content,
            tool_calls=[_lc_call(c) for c in calls],
            invalid_tool_calls=[invalid_tool_call(args=block, error="not a JSON tool call") for block in invalid],
            usage_metadata=_usage(cost),
            response_metadata=metadata,
        )
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info={"finish_reason": metadata["finish_reason"]})],
            llm_output={"token_usage": dict(_usage(cost)), "cost": cost.to_dict(), "model_name": model.pair_name},
        )

    def chunk(self, event: TokenEvent, cost: Cost | None) -> ChatGenerationChunk:
        """The message chunk of one streamed token; the last carries the finish reason, usage and cost."""
        last = cost is not None and event.finish_reason is not None
        splitter = self._splitter
        text, calls = (event.text, []) if splitter is None else splitter.push(event.text, last=last)
        chunks = [_lc_chunk(c, self._made + i) for i, c in enumerate(calls)]
        self._made += len(calls)
        metadata: dict[str, Any] = {"models": event.role.letter}
        if not last:
            return ChatGenerationChunk(
                message=AIMessageChunk(content=text, tool_call_chunks=chunks, response_metadata=metadata)
            )
        assert cost is not None and event.finish_reason is not None
        finish = "tool_calls" if self._made else event.finish_reason.value
        metadata.update(finish_reason=finish, model_name=self.model.pair_name, cost=cost.to_dict())
        message = AIMessageChunk(
            content=text,
            tool_call_chunks=chunks,
            usage_metadata=_usage(cost),
            response_metadata=metadata,
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)
