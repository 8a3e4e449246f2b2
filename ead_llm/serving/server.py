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

Bounded and guarded (:class:`ServerLimits`): a body over ``max_request_bytes`` gets a 413 before the rest of
it is read; a request may ask for at most ``max_sequences`` sequences (prompts x ``n``); every malformed field
is a 400 that names it, and a constraint that does not compile a 400 before any byte is sent; an error after
a stream has started ends it with an OpenAI-style ``error`` event. With an ``api_key`` every route but
``/health`` needs ``Authorization: Bearer <key>`` (else 401); ``allowed_origins`` turns on CORS for them.
Requests are prepared off the event loop; a client that leaves before its answer cancels its requests,
which stop within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ead_llm.accounting.ledger import Cost
from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
from ead_llm.adapters.pair_model import Until
from ead_llm.adapters.prompts import prompt_text, render
from ead_llm.adapters.tool_calls import CallReader, ToolCall, ToolPlan, finish_reason, plan_tools, read_answer
from ead_llm.core.grammar import Constraint, JsonBounds
from ead_llm.core.request import Completion, Prompt
from ead_llm.core.request import Request as EngineRequest
from ead_llm.core.types import TokenEvent
from ead_llm.policies.base import Policy, policy_from_description
from ead_llm.serving.errors import error_body
from ead_llm.serving.limits import ServerLimits

logger = logging.getLogger(__name__)
UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix")
MAX_N = 16
UNAUTHENTICATED = ("/health",)
"""Routes answered without the API key (a load balancer's health check)."""


# -- request bodies -----------------------------------------------------------------------------------


class _Open(BaseModel):
    """OpenAI's objects: unknown fields are accepted and ignored, as OpenAI's servers do."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False


class _Body(_Open):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    policy: dict[str, Any] | None = None
    """ead-llm's own field: the policy for this request, as ``describe_policy`` writes it."""
    prompt_truncation: Literal["error", "left"] | None = None
    ignore_eos: bool | None = None
    """Generate past EOS (fixed-length benchmarks; vLLM's server takes it too)."""


class CompletionBody(_Body):
    prompt: str | list[str] = Field(min_length=1)
    echo: bool = False


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionSpec(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Open):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Open):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required", "any"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


# -- errors ---------------------------------------------------------------------------------------------


class ServerError(ValueError):
    """A request the server refuses (HTTP 400 or 404)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


class RequestTooLarge(HTTPException):
    """A body longer than the server takes (HTTP 413; an HTTPException so that FastAPI's body reader passes it on)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over {limit} bytes: send less")


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = {404: "not_found_error", 401: "authentication_error", 500: "server_error"}.get(
        status, "invalid_request_error"
    )
    return JSONResponse(error_body(message, kind, param), status)


def _usage(cost: Cost) -> dict[str, Any]:
    """OpenAI's usage (with ``prompt_tokens_details.cached_tokens``: the prompt positions the large model took
    from its prefix cache) and the whole cost dict beside it."""
    cached = cost.large_cached_tokens
    return {
        **cost.to_dict(),
        "total_tokens": cost.prompt_tokens + cost.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise ServerError(f"message content of type {part.type!r} is not supported: send text", param="messages")
        parts.append(part.text or "")
    return "".join(parts)


def _call_of(call: ToolCallIn) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` item of a request's assistant message, as the prompt renderer takes it."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ServerError(f"tool call arguments must be JSON, got {arguments!r}", param="messages") from None
    return {"name": call.function.name, "arguments": arguments, "id": call.id}


def _response_format(value: ResponseFormat | None, bounds: JsonBounds | None) -> Constraint | None:
    """The constraint of OpenAI's ``response_format``: ``text`` (none), ``json_object``, ``json_schema``."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return Constraint.json_object()
    if value.json_schema is None or value.json_schema.schema_ is None:
        raise ServerError("response_format.json_schema.schema must be a JSON schema object", param="response_format")
    try:
        return Constraint.json_schema(
            value.json_schema.schema_, strict=value.json_schema.strict is not False, bounds=bounds
        )
    except ValueError as exc:
        raise ServerError(f"response_format: {exc}", param="response_format") from exc


def default_model_name(llm: EntropyAdaptiveLLM) -> str:
    """A short model id: ``ead-llm/embedded``, or ``ead-llm/`` and the large model's name."""
    return llm.model_name


# -- limits ---------------------------------------------------------------------------------------------


class BodyLimit:
    """ASGI middleware: a body declared longer than ``limit`` is answered 413 before any of it is read; one that
    turns out longer (chunked) stops being read at ``limit`` (:class:`RequestTooLarge`)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            response = _error(f"the request body is over {self.limit} bytes: send less", 413)
            await response(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise RequestTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


class ApiKey:
    """ASGI middleware: every route but :data:`UNAUTHENTICATED` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNAUTHENTICATED or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            response = _error("a valid API key is needed: send Authorization: Bearer <key>", 401)
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# -- the server -----------------------------------------------------------------------------------------


@dataclass
class Job:
    """A prepared request: the engine requests, and how their results become the HTTP answer."""

    requests: list[EngineRequest]
    respond: Callable[[list[Completion], Cost], dict[str, Any]]
    stream: Callable[[AsyncIterator[tuple[TokenEvent, Cost | None]]], AsyncIterator[str]] | None = None
    """For ``stream: true``: server-sent events from the one request's events."""
    until: Until | None = None
    """Where the one request's answer ends early (a repeated tool call); None: at EOS, a stop or max_tokens."""


class Server:
    """The OpenAI-compatible surface of one :class:`EntropyAdaptiveLLM` (its pair, policy and defaults)."""

    def __init__(
        self, llm: EntropyAdaptiveLLM, model_name: str | None = None, limits: ServerLimits | None = None
    ) -> None:
        self.llm = llm
        self.model_name = model_name or default_model_name(llm)
        self.aliases = {self.model_name, f"ead-llm/{llm.pair_name}"}
        """Model ids a request may name: the served name, and the long ``ead-llm/<small>+<large>`` form."""
        self.limits = limits or ServerLimits()
        self.created = int(time.time())

    # -- request -> engine requests ---------------------------------------------------------------

    def _check(self, body: _Body, prompts: int) -> None:
        if body.model is not None and body.model not in self.aliases:
            raise ServerError(f"model {body.model!r} is not served here; use {self.model_name!r}", 404, "model")
        refused = [name for name in UNSUPPORTED if (body.model_extra or {}).get(name) not in (None, [], {}, "none")]
        if body.logprobs not in (None, False, 0):
            refused.append("logprobs")
        if refused:
            raise ServerError(f"not supported by ead-llm: {refused}", param=refused[0])
        if prompts * body.n > self.limits.max_sequences:
            raise ServerError(
                f"this request asks for {prompts * body.n} sequences ({prompts} prompts x n={body.n}); this server "
                f"takes at most {self.limits.max_sequences} per request: send fewer prompts or a smaller n",
                param="n" if prompts == 1 else "prompt",
            )
        if body.stream and prompts * body.n != 1:
            raise ServerError("streaming takes one prompt and n=1", param="stream")

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
            ("ignore_eos", body.ignore_eos),
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
        except (TypeError, ValueError, KeyError) as exc:
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

    def _chat_prompt(self, body: ChatBody, plan: ToolPlan) -> Prompt:
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
        llm = self.llm
        return render(
            llm.shared_engine.tokenizer, messages, llm.resolved_prompt_format, plan.prompt_tools, plan.instruction()
        )

    def _tools(self, body: ChatBody) -> ToolPlan:
        """The tools offered, the tool mode, and the constraint (forced calls, the response format, or either)."""
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
        bounds = self.llm.json_bounds
        answer = _response_format(body.response_format, bounds)
        try:
            return plan_tools(tools, choice, body.parallel_tool_calls, answer=answer, bounds=bounds)
        except ValueError as exc:
            text = str(exc)
            param = next((p for p in ("response_format", "tool_choice") if p in text), "tools")
            raise ServerError(text, param=param) from exc

    # -- jobs ---------------------------------------------------------------------------------------

    def completions(self, body: CompletionBody) -> Job:
        """Check and prepare a completions request (raises :class:`ServerError` for what it refuses)."""
        prompts: list[Prompt] = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        self._check(body, len(prompts))
        requests = self._requests(prompts, body)

        def respond(completions: list[Completion], total: Cost) -> dict[str, Any]:
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

        stream = None
        if body.stream:

            def stream(events: AsyncIterator[tuple[TokenEvent, Cost | None]]) -> AsyncIterator[str]:
                return self._chunks("text_completion", events, body)

        return Job(requests, respond, stream)

    def chat(self, body: ChatBody) -> Job:
        """Check and prepare a chat completions request."""
        self._check(body, 1)
        plan = self._tools(body)
        prompt = self._chat_prompt(body, plan)
        requests = self._requests([prompt], body, plan.constraint)
        tokenizer = self.llm.shared_engine.tokenizer
        prefix = prompt_text(tokenizer, prompt)

        def respond(completions: list[Completion], total: Cost) -> dict[str, Any]:
            choices = []
            for c in completions:
                content, calls = c.text, list[ToolCall]()
                if plan.mode != "none":
                    content, calls, invalid = read_answer(
                        tokenizer,
                        c.text,
                        c.finish_reason.value,
                        prefix=prefix,
                        tools=plan.tools,
                        parallel=plan.parallel,
                    )
                    if not calls and plan.forced:
                        raise ServerError(_no_call(invalid[0].error if invalid else None), param="max_tokens")
                message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
                if calls:
                    message["tool_calls"] = [call.openai() for call in calls]
                finish = finish_reason(c.finish_reason.value, len(calls))
                choices.append({"index": c.index, "message": message, "finish_reason": finish, "logprobs": None})
            return self._envelope("chat.completion", choices, total)

        stream = None
        if body.stream:

            def stream(events: AsyncIterator[tuple[TokenEvent, Cost | None]]) -> AsyncIterator[str]:
                return self._chunks("chat.completion.chunk", events, body, plan)

        until = plan.until() if len(requests) == 1 and not requests[0].policy.votes else None
        return Job(requests, respond, stream, until)

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

    async def _chunks(
        self,
        kind: str,
        events: AsyncIterator[tuple[TokenEvent, Cost | None]],
        body: _Body,
        plan: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per token; the last carries finish_reason and usage. A failure after the
        first byte ends the stream with an ``error`` event (OpenAI's clients raise it), as does a forced tool call
        that the answer never completed."""
        reader: CallReader | None = plan.reader() if plan is not None else None
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chat = kind.startswith("chat")
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # one id for all the chunks
        first, calls_made = True, 0
        try:
            async for event, cost in events:
                finish = None if event.finish_reason is None else event.finish_reason.value
                if chat:
                    text, calls, invalid = (event.text, [], []) if reader is None else reader.push(event.text, finish)
                    delta: dict[str, Any] = {"content": text}
                    if first:
                        delta["role"] = "assistant"
                    if calls:
                        delta["tool_calls"] = [{"index": calls_made + i, **c.openai()} for i, c in enumerate(calls)]
                        calls_made += len(calls)
                    if finish is not None:
                        finish = finish_reason(finish, calls_made)
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
                if chat and finish is not None and not calls_made and plan is not None and plan.forced:
                    error = _no_call(invalid[0].error if invalid else None)
                    yield f"data: {json.dumps(error_body(error, 'invalid_request_error', 'max_tokens'))}\n\n"
                    return
        except Exception as exc:  # the status line is sent: the error goes in the stream
            logger.warning("a stream failed after it started: %s", exc)
            kind_of = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
            yield f"data: {json.dumps(error_body(str(exc), kind_of))}\n\n"
            return
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()
        yield "data: [DONE]\n\n"


async def _read(llm: EntropyAdaptiveLLM, request: EngineRequest, until: Until) -> tuple[list[Completion], Cost]:
    """One request run to its end or to where ``until`` ends it, as the completion ``_arun`` would give."""
    events = await llm._aopen_events(request, until)
    taken: list[tuple[TokenEvent, Cost | None]] = []
    try:
        async for item in events:
            taken.append(item)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    last, cost = taken[-1]
    if cost is None or last.finish_reason is None:
        raise RuntimeError("the answer ended without its last event")
    completion = Completion(
        index=0,
        text="".join(e.text for e, _ in taken),
        token_ids=tuple(e.token_id for e, _ in taken),
        roles=tuple(e.role for e, _ in taken),
        entropies=tuple(e.entropy for e, _ in taken),
        finish_reason=last.finish_reason,
        cost=cost,
    )
    return [completion], cost


def _no_call(reason: str | None) -> str:
    """Why an answer that had to call a tool holds no call (OpenAI's words for a cut answer)."""
    return "Could not finish the message because max_tokens was reached before the tool call was complete: " + (
        "raise max_tokens" if reason is None else reason
    )


async def _until_disconnected(request: Request) -> None:
    """Returns once the client has gone (its connection closed before the answer)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """``(True, result)`` of ``work``, or ``(False, None)`` when the client left first (``work`` is then
    cancelled: its requests stop within one engine step)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


def create_app(
    llm: EntropyAdaptiveLLM | None = None, model_name: str | None = None, limits: ServerLimits | None = None
) -> FastAPI:
    """The FastAPI application serving ``llm`` (default: the embedded pair) within ``limits``."""
    server = Server(llm or EntropyAdaptiveLLM(), model_name, limits)
    limits = server.limits
    app = FastAPI(title="ead-llm", description="OpenAI-compatible server over an entropy-adaptive model pair")
    app.state.server = server

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
        return _error(str(exc), exc.status, exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return _error(str(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(str(exc.detail), exc.status_code)  # OpenAI's error shape for 404, 405, 413...

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return _error(f"{where}: {first.get('msg', 'invalid request')}", 400, where or None)

    @app.exception_handler(TimeoutError)
    async def _timeout(request: Request, exc: TimeoutError) -> JSONResponse:
        return _error(str(exc), 504)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("ead-llm server error")
        return _error(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_name, **server.llm.shared_engine.load}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": server.model_name, "object": "model", "created": server.created, "owned_by": "ead-llm"}],
        }

    async def answer(request: Request, prepare: Callable[[Any], Job], body: _Body) -> Any:
        job = await asyncio.to_thread(prepare, body)  # tokenizers and grammars off the event loop
        if job.stream is not None:
            events = await server.llm._aopen_events(job.requests[0], job.until)  # queued: a bad one is a 400 here
            return StreamingResponse(job.stream(events), media_type="text/event-stream")
        work = server.llm._arun(job.requests) if job.until is None else _read(server.llm, job.requests[0], job.until)
        finished, result = await _unless_disconnected(request, work)
        if not finished:
            return Response(status_code=499)  # nobody reads it: the client has gone
        return job.respond(*result)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        return await answer(request, server.completions, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        return await answer(request, server.chat, body)

    app.add_middleware(BodyLimit, limit=limits.body_limit(server.llm.shared_engine.max_positions))
    if limits.api_key is not None:
        app.add_middleware(ApiKey, key=limits.api_key)
    if limits.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(limits.allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    return app
