"""Tool calling on the pair, framework-neutral (the LangChain chat model and the server share it).

Tools are OpenAI function specs (``{"type": "function", "function": {"name", "description",
"parameters"}}``). They reach the model through the tokenizer's chat template (``tools=``) when the
template renders them, else through :func:`tools_instruction`, a system text in the Hermes/Qwen
format that most open instruct models were trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` decides the grammar: ``auto`` (the default) leaves the text free and parses any calls
it contains; ``none`` hides the tools; ``required`` (or LangChain's ``any``) and a named tool constrain
the whole answer to one or more calls (one for a named tool) whose JSON is valid under the tools'
parameter schemas, so such a call always parses, whichever model writes its tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ead_llm.core.grammar import Constraint, closed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8
"""Most calls one answer may hold under ``required`` (a bound, so a constrained answer always ends)."""
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def plan_tools(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None = None,  # noqa: FBT001 (OpenAI's field)
) -> tuple[list[dict[str, Any]], str, Constraint | None]:
    """What a request's tool options mean: the tools offered to the model, the mode (``auto``, ``none``,
    ``required``, ``named``) and the grammar it imposes (None for free text). Refuses bad specs, and a
    forcing ``tool_choice`` without tools (``ValueError``)."""
    specs = check_tools(tools or [])
    if not specs:
        if tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice={tool_choice!r} needs tools to choose from")
        return [], "none", None
    offered, mode = chosen_tools(specs, tool_choice)
    return offered, mode, tool_constraint(offered, mode, parallel=parallel_tool_calls is not False)


def split_calls(
    tokenizer: Any, text: str, prefix: str, tools: list[dict[str, Any]], salt: str
) -> tuple[str, list[ToolCall], list[str]]:
    """An answer's text, its calls and its unparsable ``<tool_call>`` blocks: by the tokenizer's response
    template when it has one (:func:`parse_with_template`), else by :func:`parse_tool_calls`."""
    native = parse_with_template(tokenizer, text, prefix, tools, salt=salt)
    if native is not None:
        return native[0], native[1], []
    return parse_tool_calls(text, salt=salt)


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one call: ``{"name": <a tool>, "arguments": <its parameters>}``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": closed(t["function"]["parameters"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def tool_constraint(tools: list[dict[str, Any]], mode: str, *, parallel: bool = True) -> Constraint | None:
    """The grammar of an answer that must call a tool (``required``, ``named``); None for free text."""
    if mode not in ("required", "named"):
        return None
    call = f'"{OPEN}\\n" %json {json.dumps(call_schema(tools))} "\\n{CLOSE}"'
    more = MAX_PARALLEL_CALLS - 1 if parallel and mode == "required" else 0
    start = "start: call" + (f' ("\\n" call){{0,{more}}}' if more else "")
    return Constraint.lark(f"{start}\ncall: {call}\n")


def tools_instruction(tools: list[dict[str, Any]]) -> str:
    """The system text that offers ``tools`` to a model whose chat template does not render them."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You may call the following tools. To call one, answer with a block per call:\n"
        f'{OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}\n'
        f"<tools>\n{listed}\n</tools>"
    )


def call_id(index: int, name: str, arguments: dict[str, Any], salt: str = "") -> str:
    """A stable id of a call (the same answer gets the same ids, as the same seed gets the same text)."""
    digest = hashlib.sha256(f"{salt}|{index}|{name}|{json.dumps(arguments, sort_keys=True)}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _call(raw: str, index: int, salt: str) -> ToolCall | None:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], arguments, call_id(index, data["name"], arguments, salt))


def parse_tool_calls(text: str, salt: str = "") -> tuple[str, list[ToolCall], list[str]]:
    """Split an answer into its text and its ``<tool_call>`` blocks: ``(content, calls, invalid)``, where
    ``invalid`` holds the blocks that are not a JSON call (they are left out of the content)."""
    calls: list[ToolCall] = []
    invalid: list[str] = []
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1), len(calls), salt)
        if call is None:
            invalid.append(match.group(0))
        else:
            calls.append(call)
    content = _BLOCK.sub("", text).strip() if calls or invalid else text
    return content, calls, invalid


def parse_with_template(tokenizer: Any, text: str, prefix: str, tools: list[dict[str, Any]], salt: str = "") -> Any:
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
        calls.append(ToolCall(function["name"], arguments, call_id(len(calls), function["name"], arguments, salt)))
    return str(parsed.get("content") or ""), calls


class CallSplitter:
    """Streams an answer's text while holding back ``<tool_call>`` blocks: ``push`` returns the text that
    is surely not part of a block, and the calls completed so far."""

    def __init__(self, salt: str = "") -> None:
        self._held = ""
        self._calls = 0
        self._salt = salt

    def push(self, text: str, *, last: bool = False) -> tuple[str, list[ToolCall]]:
        self._held += text
        out, calls = [], []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = 0 if last else _partial_suffix(self._held, OPEN)
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            out.append(self._held[:start])
            end = self._held.find(CLOSE, start)
            if end < 0:
                self._held = self._held[start:]
                if last:  # an unclosed block at the end is text, not a call
                    out.append(self._held)
                    self._held = ""
                break
            block = self._held[start : end + len(CLOSE)]
            call = _call(block[len(OPEN) : -len(CLOSE)].strip(), self._calls, self._salt)
            if call is None:
                out.append(block)
            else:
                calls.append(call)
                self._calls += 1
            self._held = self._held[end + len(CLOSE) :]
        return "".join(out), calls


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
