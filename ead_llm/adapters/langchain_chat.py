"""``ChatEntropyAdaptive``: the pair as a LangChain chat model over the shared engine (a thin adapter).

Messages become the prompt through the tokenizer's chat template, or a plain ``Role: text``
fallback when it has none (see :mod:`ead_llm.adapters.prompts`); on the embedded pair the default format is
``text`` (a single human message is passed through unchanged). Usage is on ``usage_metadata``; the
cost dict in ``response_metadata["cost"]``. Tool calling, structured output and non-text content
are not supported.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LangSmithParams
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from ead_llm.accounting.ledger import Cost
from ead_llm.adapters.pair_model import PairModel, iterate_in_thread
from ead_llm.adapters.prompts import render
from ead_llm.core.request import Prompt
from ead_llm.policies.base import describe_policy


def _text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatEntropyAdaptive reads text only; got a {kind!r} content block")
    return "".join(parts)


def message_turns(messages: list[BaseMessage]) -> list[tuple[str, str]]:
    """``(role, text)`` turns of LangChain messages (system, human, AI, or chat messages with those roles)."""
    turns = []
    for message in messages:
        if isinstance(message, SystemMessage):
            role = "system"
        elif isinstance(message, HumanMessage):
            role = "user"
        elif isinstance(message, AIMessage):
            role = "assistant"
        elif isinstance(message, ChatMessage) and message.role in ("system", "user", "assistant"):
            role = message.role
        else:
            raise ValueError(
                f"ChatEntropyAdaptive takes system, human and AI messages; got {type(message).__name__} "
                "(tool calling is not supported)"
            )
        turns.append((role, _text(message)))
    return turns


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

    def _prompt(self, messages: list[BaseMessage]) -> Prompt:
        return render(self.shared_engine.tokenizer, message_turns(messages), self.resolved_prompt_format)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        requests = self._requests([self._prompt(messages)], stop, kwargs)
        (completion,), cost = self._run(requests)
        metadata = {
            "finish_reason": completion.finish_reason.value,
            "model_name": self.pair_name,
            "cost": cost.to_dict(),
            "models": "".join(r.letter for r in completion.roles),
            "policy": describe_policy(requests[0].policy),
        }
        message = AIMessage(content=completion.text, usage_metadata=_usage(cost), response_metadata=metadata)
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info={"finish_reason": metadata["finish_reason"]})],
            llm_output={"token_usage": dict(_usage(cost)), "cost": cost.to_dict(), "model_name": self.pair_name},
        )

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        (request,) = self._requests([self._prompt(messages)], stop, kwargs)
        for event, cost in self._stream_events(request):
            metadata: dict[str, Any] = {"models": event.role.letter}
            if cost is not None and event.finish_reason is not None:
                metadata.update(finish_reason=event.finish_reason.value, model_name=self.pair_name, cost=cost.to_dict())
                message = AIMessageChunk(
                    content=event.text, usage_metadata=_usage(cost), response_metadata=metadata, chunk_position="last"
                )
            else:
                message = AIMessageChunk(content=event.text, response_metadata=metadata)
            chunk = ChatGenerationChunk(message=message)
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
        iterator = self._stream(messages, stop, None, **kwargs)
        async for chunk in iterate_in_thread(iterator):
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
