"""``ead-llm serve``: an OpenAI-compatible HTTP server over one shared engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``. Every caller joins the engine's running batch. ``usage`` in
each response (and in the last streamed chunk, or a usage chunk when ``stream_options.include_usage``)
holds OpenAI's three token counts plus the whole cost dict. The policy is the server's unless a
request names one in an extra ``policy`` field (``{"policy": "large_only"}``, or ``{"policy":
"ead", "threshold": 0.1}``: the fields of ``describe_policy``).

Chat completions take ``tools``, ``tool_choice`` (``auto``, ``none``, ``required``, a named function)
and ``parallel_tool_calls``, and answer with ``tool_calls`` (streamed as ``delta.tool_calls``, one
whole call per delta); ``response_format`` ``json_object`` and ``json_schema`` constrain the answer.
A required or named tool and a response format are enforced by the engine's grammar, whichever
model writes each token (:mod:`ead_llm.adapters.tool_calls`). A streamed completion keeps one ``id``
across its chunks. Unsupported features (legacy ``functions``, logprobs, ``logit_bias``, ``suffix``)
are refused with a 400 that names them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ead_llm.accounting.ledger import Cost
from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
from ead_llm.adapters.prompts import prompt_text, render
from ead_llm.adapters.tool_calls import CallSplitter, ToolCall, plan_tools, split_calls
from ead_llm.core.grammar import Constraint
from ead_llm.core.request import Prompt
from ead_llm.core.request import Request as EngineRequest
from ead_llm.core.types import TokenEvent
from ead_llm.policies.base import Policy, policy_from_description

UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix")


class _Body(BaseModel):
    """Fields shared by both endpoints; unknown fields are accepted and ignored, as OpenAI's servers do."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | int | None = None
    policy: dict[str, Any] | None = None
    prompt_truncation: str | None = None


class CompletionBody(_Body):
    prompt: str | list[str]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class ServerError(ValueError):
    """A request the server refuses (HTTP 400 or 404)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _usage(cost: Cost) -> dict[str, Any]:
    return {**cost.to_dict(), "total_tokens": cost.prompt_tokens + cost.completion_tokens}


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ServerError(
                f"message content of type {part.get('type')!r} is not supported: send text", param="messages"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _call_of(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` item of a request's assistant message, as the prompt renderer takes it."""
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise ServerError(f"tool call arguments must be JSON, got {arguments!r}", param="messages") from None
    if not isinstance(function.get("name"), str):
        raise ServerError(f"a tool call needs function.name, got {call!r}", param="messages")
    return {"name": function["name"], "arguments": parsed, "id": call.get("id")}


def _response_format(value: dict[str, Any] | None) -> Constraint | None:
    """The constraint of OpenAI's ``response_format``: ``text`` (none), ``json_object``, ``json_schema``."""
    if value is None or value.get("type") in (None, "text"):
        return None
    if value.get("type") == "json_object":
        return Constraint.json_object()
    if value.get("type") == "json_schema":
        spec = value.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ServerError(
                "response_format.json_schema.schema must be a JSON schema object", param="response_format"
            )
        try:
            return Constraint.json_schema(schema, strict=bool(spec.get("strict", True)))
        except ValueError as exc:
            raise ServerError(f"response_format: {exc}", param="response_format") from exc
    raise ServerError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {value.get('type')!r}",
        param="response_format",
    )


def default_model_name(llm: EntropyAdaptiveLLM) -> str:
    """A short model id: ``ead-llm/embedded``, or ``ead-llm/<large model's last path part>``."""
    if llm.large is None:
        return "ead-llm/embedded"
    return "ead-llm/" + llm.large.rstrip("/").split("/")[-1].removesuffix(".gguf")


class Server:
    """The OpenAI-compatible surface of one :class:`EntropyAdaptiveLLM` (its pair, policy and defaults)."""

    def __init__(self, llm: EntropyAdaptiveLLM, model_name: str | None = None) -> None:
        self.llm = llm
        self.model_name = model_name or default_model_name(llm)
        self.aliases = {self.model_name, f"ead-llm/{llm.pair_name}"}
        """Model ids a request may name: the served name, and the long ``ead-llm/<small>+<large>`` form."""
        self.created = int(time.time())

    # -- request -> engine requests ---------------------------------------------------------------

    def _check(self, body: _Body) -> None:
        if body.model is not None and body.model not in self.aliases:
            raise ServerError(f"model {body.model!r} is not served here; use {self.model_name!r}", 404, "model")
        refused = [name for name in UNSUPPORTED if (body.model_extra or {}).get(name) not in (None, [], {}, "none")]
        if body.logprobs not in (None, False, 0):
            refused.append("logprobs")
        if refused:
            raise ServerError(f"not supported by ead-llm: {refused}", param=refused[0])
        if isinstance(body.n, bool) or not 1 <= body.n <= 16:
            raise ServerError(f"n must be between 1 and 16, got {body.n}", param="n")

    def _options(self, body: _Body) -> dict[str, Any]:
        options: dict[str, Any] = {}
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        for name, value in (
            ("max_tokens", max_tokens),
            ("temperature", body.temperature),
            ("top_p", body.top_p),
            ("top_k", body.top_k),
            ("seed", body.seed),
            ("prompt_truncation", body.prompt_truncation),
        ):
            if value is not None:
                options[name] = value
        if body.policy is not None:
            options["policy"] = self._policy(body.policy)
        return options

    @staticmethod
    def _policy(description: dict[str, Any]) -> Policy:
        try:
            return policy_from_description(description)
        except (TypeError, ValueError) as exc:
            raise ServerError(f"policy: {exc}", param="policy") from exc

    def _requests(
        self, prompts: list[Prompt], body: _Body, constraint: Constraint | None = None
    ) -> list[EngineRequest]:
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        options = self._options(body)
        if constraint is not None:
            options["grammar"] = constraint
        requests = []
        for prompt in prompts:
            for k in range(body.n):
                (request,) = self.llm._requests([prompt], stop, options, sample_index=k)
                self._check_length(request)
                requests.append(request)
        return requests

    def _check_length(self, request: EngineRequest) -> None:
        """Refuse a request whose prompt and ``max_tokens`` exceed the context, as vLLM and OpenAI do (the
        library itself would quietly stop at the context's end)."""
        engine = self.llm.shared_engine
        limit = engine.max_positions
        if limit is None or request.sampling.prompt_truncation == "left":
            return
        prompt = len(engine.prompt_ids(request))
        wanted = request.sampling.max_tokens
        if prompt + wanted > limit:
            raise ServerError(
                f"this model's context is {limit} tokens; the request asks for {prompt + wanted} ({prompt} in the "
                f"prompt, max_tokens {wanted}): lower max_tokens to at most {max(limit - prompt, 0)}",
                param="max_tokens",
            )

    def _chat_prompt(self, body: ChatBody, tools: list[dict[str, Any]]) -> Prompt:
        messages = []
        for m in body.messages:
            message: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": _text(m.content),
            }
            if m.tool_calls:
                message["tool_calls"] = [_call_of(c) for c in m.tool_calls]
            if m.role == "tool":
                message["tool_call_id"], message["name"] = m.tool_call_id, m.name
            messages.append(message)
        return render(self.llm.shared_engine.tokenizer, messages, self.llm.resolved_prompt_format, tools)

    @staticmethod
    def _tools(body: ChatBody) -> tuple[list[dict[str, Any]], str, Constraint | None]:
        """The tools offered, the tool mode, and the constraint (a forced tool, or the response format)."""
        try:
            offered, mode, constraint = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ValueError as exc:
            raise ServerError(str(exc), param="tools" if "tool_choice" not in str(exc) else "tool_choice") from exc
        response = _response_format(body.response_format)
        if constraint is not None and response is not None:
            raise ServerError(
                "a required or named tool and a response_format cannot both constrain one answer",
                param="response_format",
            )
        return offered, mode, constraint or response

    # -- responses --------------------------------------------------------------------------------

    def completions(self, body: CompletionBody) -> dict[str, Any] | Iterator[str]:
        self._check(body)
        prompts: list[Prompt] = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts:
            raise ServerError("prompt must not be empty", param="prompt")
        requests = self._requests(prompts, body)
        if body.stream:
            if len(requests) != 1:
                raise ServerError("streaming takes one prompt and n=1", param="stream")
            return self._stream("text_completion", requests[0], body)
        completions, total = self.llm._run(requests)
        choices = [
            {
                "index": c.index,
                "text": (requests[c.index].prompt if body.echo else "") + c.text,  # type: ignore[operator]
                "finish_reason": c.finish_reason.value,
                "logprobs": None,
            }
            for c in completions
        ]
        return self._envelope("text_completion", choices, total)

    def chat(self, body: ChatBody) -> dict[str, Any] | Iterator[str]:
        self._check(body)
        tools, mode, constraint = self._tools(body)
        prompt = self._chat_prompt(body, tools)
        requests = self._requests([prompt], body, constraint)
        tokenizer = self.llm.shared_engine.tokenizer
        salt = prompt_text(tokenizer, prompt)
        if body.stream:
            if len(requests) != 1:
                raise ServerError("streaming takes n=1", param="stream")
            splitter = CallSplitter(salt=f"{salt}|0") if mode != "none" else None
            return self._chunks("chat.completion.chunk", self.llm._stream_events(requests[0]), body, splitter)
        completions, total = self.llm._run(requests)
        choices = []
        for c in completions:
            content, calls = c.text, list[ToolCall]()
            if mode != "none":
                content, calls, _ = split_calls(tokenizer, c.text, salt, tools, f"{salt}|{c.index}")
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            finish = "tool_calls" if calls else c.finish_reason.value
            choices.append({"index": c.index, "message": message, "finish_reason": finish, "logprobs": None})
        return self._envelope("chat.completion", choices, total)

    def _envelope(
        self, kind: str, choices: list[dict[str, Any]], cost: Cost | None, completion_id: str | None = None
    ) -> dict[str, Any]:
        prefix = "cmpl" if kind.startswith("text") else "chatcmpl"
        out: dict[str, Any] = {
            "id": completion_id or f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
        }
        if cost is not None:
            out["usage"] = _usage(cost)
        return out

    def _stream(self, kind: str, request: EngineRequest, body: _Body) -> Iterator[str]:
        """Server-sent events: one chunk per token; the last carries finish_reason and usage.

        The request is checked and queued before this returns (a bad one raises here, so the client
        gets an error status, not a stream that breaks off)."""
        return self._chunks(kind, self.llm._stream_events(request), body)

    def _chunks(
        self,
        kind: str,
        events: Iterator[tuple[TokenEvent, Cost | None]],
        body: _Body,
        splitter: CallSplitter | None = None,
    ) -> Iterator[str]:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        chat = kind.startswith("chat")
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # one id for all the chunks
        first, calls_made = True, 0
        for event, cost in events:
            finish = None if event.finish_reason is None else event.finish_reason.value
            if chat:
                text, calls = (
                    (event.text, []) if splitter is None else splitter.push(event.text, last=finish is not None)
                )
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                if calls:
                    delta["tool_calls"] = [{"index": calls_made + i, **c.openai()} for i, c in enumerate(calls)]
                    calls_made += len(calls)
                if finish is not None and calls_made:
                    finish = "tool_calls"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": event.text, "finish_reason": finish, "logprobs": None}
            first = False
            chunk = self._envelope(kind, [choice], None, completion_id)
            chunk["ead_model"] = event.role.letter
            if cost is not None and not include_usage:
                chunk["usage"] = _usage(cost)
            yield f"data: {json.dumps(chunk)}\n\n"
            if cost is not None and include_usage:
                yield f"data: {json.dumps(self._envelope(kind, [], cost, completion_id))}\n\n"
        yield "data: [DONE]\n\n"


def create_app(llm: EntropyAdaptiveLLM | None = None, model_name: str | None = None) -> FastAPI:
    """The FastAPI application serving ``llm`` (default: the embedded pair)."""
    server = Server(llm or EntropyAdaptiveLLM(), model_name)
    app = FastAPI(title="ead-llm", description="OpenAI-compatible server over an entropy-adaptive model pair")
    app.state.server = server

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
        return _error(str(exc), exc.status, exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return _error(str(exc), 400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return _error(f"{where}: {first.get('msg', 'invalid request')}", 400, where or None)

    @app.exception_handler(TimeoutError)
    async def _timeout(request: Request, exc: TimeoutError) -> JSONResponse:
        return _error(str(exc), 504)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_name, **server.llm.shared_engine.load}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": server.model_name, "object": "model", "created": server.created, "owned_by": "ead-llm"}],
        }

    def respond(result: dict[str, Any] | Iterator[str]) -> Any:
        if isinstance(result, dict):
            return result
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    def completions(body: CompletionBody) -> Any:
        return respond(server.completions(body))

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatBody) -> Any:
        return respond(server.chat(body))

    return app
