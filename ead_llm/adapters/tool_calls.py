"""Tool calling on the pair, framework-neutral (the LangChain chat model and the server share it).

Tools are OpenAI function specs (``{"type": "function", "function": {"name", "description",
"parameters"}}``). They reach the model through the tokenizer's chat template (``tools=``) when the
template renders them, else through :func:`tools_instruction`, a system text in the Hermes/Qwen
format that most open instruct models were trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` decides the grammar: ``auto`` (the default) leaves the text free and parses any calls
it contains; ``none`` keeps calls out of the answer (the tools stay in the prompt, as with a named tool);
``required`` (or LangChain's ``any``) and a named tool constrain the whole answer to one or more calls (one
for a named tool) whose JSON is valid under the tools' parameter schemas, so such a call always parses,
whichever model writes its tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ead_llm.core.grammar import DEFAULT_BOUNDS, Constraint, JsonBounds, closed
from ead_llm.core.types import TokenEvent

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_CALL = Constraint.lark(f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{OPEN}.*)/\n")
"""Any text without a call block: ``tool_choice="none"`` with the tools in the prompt."""
MAX_PARALLEL_CALLS = 8
"""Most calls one answer may hold under ``required`` (a bound, so a constrained answer always ends)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name, its arguments, and an id for the tool's reply to name."""

    name: str
    arguments: dict[str, Any]
    id: str

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` item (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI function specs, checked: each has a name and an object schema for its parameters. A name
    given twice keeps its first spec (a tool passed both as a class and as its schema is one tool)."""
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of OpenAI function specs, got {type(tools).__name__}")
    out, names = [], set()
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool needs a non-empty name, got {function!r}")
        if name in names:
            continue
        names.add(name)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def chosen_tools(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[list[dict[str, Any]], str]:
    """The tools the model may call and the mode (``auto``, ``none``, ``required``, ``named``) for
    ``tool_choice``: None/``auto``, ``none``, ``required``/``any``, a tool's name, or
    ``{"type": "function", "function": {"name": ...}}``."""
    if tool_choice is None or tool_choice == "auto":
        return tools, "auto"
    if tool_choice == "none":
        return [], "none"
    if tool_choice in ("required", "any", True):
        if not tools:
            raise ValueError("tool_choice='required' needs at least one tool")
        return tools, "required"
    name = tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
    by_name = {t["function"]["name"]: t for t in tools}
    if not isinstance(name, str) or name not in by_name:
        raise ValueError(
            f"tool_choice must be 'auto', 'none', 'required', 'any' or one of the tools {sorted(by_name)}, "
            f"got {tool_choice!r}"
        )
    return [by_name[name]], "named"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool options mean: the tools offered to the model, the mode (``auto``, ``none``,
    ``required``, ``named``), whether one answer may hold several calls, and the grammar imposed (None for
    free text)."""

    tools: list[dict[str, Any]]
    mode: str
    parallel: bool = True
    constraint: Constraint | None = None
    answer: Constraint | None = None
    """The response format's constraint, when one was asked for."""
    listed: list[dict[str, Any]] | None = None
    """The tools the prompt lists where they are more than ``tools`` (None: ``tools``). As OpenAI and vLLM do,
    ``none`` and a named tool keep every tool in the prompt and only the grammar narrows the answer: each step
    of an agent loop then starts with the same text, which the prefix cache holds."""

    @property
    def prompt_tools(self) -> list[dict[str, Any]]:
        """The tools written into the prompt."""
        return self.tools if self.listed is None else self.listed

    def instruction(self) -> str | None:
        """The system text that tells the model the answer's format (None without a response format)."""
        if self.answer is None or self.answer.kind not in ("json_schema", "json_object"):
            return None
        shape = (
            "one JSON object"
            if self.answer.kind == "json_object"
            else f"one JSON value valid under this schema:\n{self.answer.source}"
        )
        when = "When you have the final answer, do not call a tool: answer" if self.tools else "Answer"
        return f"{when} with {shape}"

    @property
    def forced(self) -> bool:
        """Whether the answer must call a tool (``required`` or a named tool)."""
        return self.mode in ("required", "named")

    def reader(self) -> CallReader | None:
        """A reader of the answer's calls (None where no tool is offered)."""
        return None if self.mode == "none" else CallReader(parallel=self.parallel)

    def until(self) -> Callable[[TokenEvent], bool] | None:
        """Where one answer ends early: at the event that completes a call the answer already made, or one more
        than ``parallel_tool_calls`` allows (a weak model repeating itself), instead of at ``max_tokens``. None
        where no tool is offered. One per answer (it reads the answer as it comes)."""
        watcher = self.reader()
        if watcher is None:
            return None

        def repeated(event: TokenEvent) -> bool:
            watcher.push(event.text)
            return watcher.dropped > 0

        return repeated


def plan_tools(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None = None,  # noqa: FBT001 (OpenAI's field)
    *,
    answer: Constraint | None = None,
    bounds: JsonBounds | None = DEFAULT_BOUNDS,
) -> ToolPlan:
    """The plan of a request's tool options. ``answer`` is the response format's constraint (OpenAI's
    ``response_format``): with tools offered under ``auto`` the answer is either calls or that JSON (an agent's
    structured final answer), alone it constrains the whole answer. Refuses bad specs, a forcing
    ``tool_choice`` without tools, and a forced call together with a response format (``ValueError``)."""
    specs = check_tools(tools or [])
    parallel = parallel_tool_calls is not False
    if not specs:
        if tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice={tool_choice!r} needs tools to choose from")
        return ToolPlan([], "none", parallel, answer, answer)
    offered, mode = chosen_tools(specs, tool_choice)
    if mode == "none":  # the tools stay in the prompt; the grammar keeps calls out of the answer
        return ToolPlan([], "none", parallel, answer or NO_CALL, answer, listed=specs)
    if mode in ("required", "named") and answer is not None:
        raise ValueError("a required or named tool and a response_format cannot both constrain one answer")
    if mode == "auto" and answer is None:
        return ToolPlan(offered, mode, parallel)
    constraint = tool_constraint(offered, mode, parallel=parallel, answer=answer, bounds=bounds)
    return ToolPlan(offered, mode, parallel, constraint, answer, listed=specs if mode == "named" else None)


def call_schema(tools: list[dict[str, Any]], bounds: JsonBounds | None = DEFAULT_BOUNDS) -> dict[str, Any]:
    """JSON schema of one call: ``{"name": <a tool>, "arguments": <its parameters>}`` (closed, and bounded
    by ``bounds`` where the parameters set no bounds)."""
    options = []
    for t in tools:
        arguments = closed(t["function"]["parameters"])
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": arguments if bounds is None else bounds.apply(arguments),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def tool_constraint(
    tools: list[dict[str, Any]],
    mode: str,
    *,
    parallel: bool = True,
    answer: Constraint | None = None,
    bounds: JsonBounds | None = DEFAULT_BOUNDS,
) -> Constraint | None:
    """The grammar of an answer that must call a tool (``required``, ``named``), or under ``auto`` with a
    response format must either call tools or be that JSON; None for free text."""
    if mode not in ("required", "named", "auto") or (mode == "auto" and answer is None):
        return None
    call = f'"{OPEN}\\n" %json {json.dumps(call_schema(tools, bounds))} "\\n{CLOSE}"'
    more = MAX_PARALLEL_CALLS - 1 if parallel and mode != "named" else 0
    calls = "call" + (f' ("\\n" call){{0,{more}}}' if more else "")
    if answer is None:
        return Constraint.lark(f"start: {calls}\ncall: {call}\n")
    return Constraint.lark(f"start: calls | answer\ncalls: {calls}\ncall: {call}\nanswer: {answer.lark_rule()}\n")


def tools_instruction(tools: list[dict[str, Any]]) -> str:
    """The system text that offers ``tools`` to a model whose chat template does not render them."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You may call the following tools. To call one, answer with a block per call:\n"
        f'{OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}\n'
        f"<tools>\n{listed}\n</tools>"
    )


def call_id() -> str:
    """A fresh id for one call (unique across calls, as OpenAI's are: an agent matches replies by it)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class InvalidCall:
    """A ``<tool_call>`` block that is not a call: the text as written and why (LangChain's
    ``invalid_tool_calls``)."""

    text: str
    error: str
    name: str | None = None


CUT_ERROR = (
    "the answer was cut by max_tokens (finish_reason='length') before this tool call was complete: raise max_tokens"
)


def _call(raw: str) -> ToolCall | str:
    """The call written in a block, or why it is not one."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return 'not a call: expected {"name": ..., "arguments": {...}}'
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return f"arguments are not JSON: {exc}"
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    return ToolCall(data["name"], arguments, call_id())


def _partial_name(raw: str) -> str | None:
    match = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
    return match.group(1) if match else None


class CallReader:
    """Reads one answer's tool calls as it is written (whole or token by token).

    ``push`` returns the text that is surely not part of a ``<tool_call>`` block, the calls completed so far
    and the blocks that are not calls. A call identical to an earlier one in the same answer (a weak model
    repeating itself) is dropped, and with ``parallel=False`` every call after the first (OpenAI's
    ``parallel_tool_calls=false``: one call at most). At the end (``finish`` given) a block left open is
    invalid, with the reason (cut by ``max_tokens``, or never closed); it is never left in the text.
    """

    def __init__(self, *, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.dropped = 0
        """Calls dropped as repeats, or beyond the first without parallel calls."""
        self._held = ""

    def push(self, text: str, finish: str | None = None) -> tuple[str, list[ToolCall], list[InvalidCall]]:
        self._held += text
        out: list[str] = []
        calls: list[ToolCall] = []
        invalid: list[InvalidCall] = []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = 0 if finish is not None else _partial_suffix(self._held, OPEN)
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            out.append(self._held[:start])
            end = self._held.find(CLOSE, start)
            if end < 0:
                self._held = self._held[start:]
                if finish is not None:
                    error = CUT_ERROR if finish == "length" else f"a {OPEN} block that was never closed"
                    invalid.append(InvalidCall(self._held, error, _partial_name(self._held)))
                    self._held = ""
                break
            block = self._held[start : end + len(CLOSE)]
            self._held = self._held[end + len(CLOSE) :]
            call = _call(block[len(OPEN) : -len(CLOSE)].strip())
            if isinstance(call, str):
                invalid.append(InvalidCall(block, call, _partial_name(block)))
            elif self._keeps(call):
                calls.append(call)
        return "".join(out), calls, invalid

    def _keeps(self, call: ToolCall) -> bool:
        repeated = any(c.name == call.name and c.arguments == call.arguments for c in self.calls)
        if repeated or (self.calls and not self.parallel):
            self.dropped += 1
            return False
        self.calls.append(call)
        return True


def read_answer(
    tokenizer: Any,
    text: str,
    finish: str,
    *,
    prefix: str = "",
    tools: Sequence[dict[str, Any]] = (),
    parallel: bool = True,
) -> tuple[str, list[ToolCall], list[InvalidCall]]:
    """A whole answer's text, calls and invalid blocks: by the tokenizer's response template when it has one
    (:func:`parse_with_template`), else by :class:`CallReader`; repeats dropped either way."""
    reader = CallReader(parallel=parallel)
    native = parse_with_template(tokenizer, text, prefix, list(tools))
    if native is None:
        content, calls, invalid = reader.push(text, finish)
        return (content.strip() if calls or invalid else content), calls, invalid
    content, calls = native
    return content, [c for c in calls if reader._keeps(c)], []


def parse_with_template(tokenizer: Any, text: str, prefix: str, tools: list[dict[str, Any]]) -> Any:
    """The tokenizer's own response parser (transformers' ``parse_response``) when it has a
    ``response_template``: ``(content, calls)``; None when it has none or its parse fails."""
    if getattr(tokenizer, "response_template", None) is None:
        return None
    try:
        parsed = tokenizer.parse_response(text, prefix=prefix, tools=tools)
    except Exception:
        return None
    calls: list[ToolCall] = []
    for item in parsed.get("tool_calls") or ():
        function = item.get("function", item)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        calls.append(ToolCall(function["name"], arguments, call_id()))
    return str(parsed.get("content") or ""), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def assistant_text(content: str, calls: Sequence[dict[str, Any]]) -> str:
    """An assistant turn with calls, written in the Hermes format (for templates that do not render calls)."""
    blocks = [
        f"{OPEN}\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}\n{CLOSE}"
        for c in calls
    ]
    return "\n".join([content, *blocks] if content else blocks)


def tool_result_text(content: str) -> str:
    """A tool's reply, for templates without a ``tool`` role."""
    return f"<tool_response>\n{content}\n</tool_response>"


def finish_reason(engine_finish: str, calls: int) -> str:
    """OpenAI's finish reason of an answer: ``tool_calls`` when it called tools, unless it was cut (``length``)."""
    return "tool_calls" if calls and engine_finish != "length" else engine_finish
