"""Turning a conversation into the prompt the pair completes.

Two formats, chosen per object (``prompt_format``):

- ``chat``: the tokenizer's own chat template with the generation prompt appended; a tokenizer
  without one gets :data:`FALLBACK_TEMPLATE`'s plain ``Role: text`` turns ending in ``Assistant:``.
- ``text``: a completion model's raw prompt: the messages' texts joined by a blank line, nothing
  added (a single user message is passed through exactly). The embedded pair uses this.

Messages are ``(role, text)`` pairs or dicts in Hugging Face's chat format, which may carry tool calls
(``{"role": "assistant", "content": ..., "tool_calls": [{"name", "arguments", "id"}]}``) and tool
replies (``{"role": "tool", "content": ..., "tool_call_id": ...}``). With ``tools=`` (OpenAI function
specs) a template that renders tools gets them, and the calls and replies, natively; any other
template (or format) gets them as text in the Hermes format (:mod:`ead_llm.adapters.tool_calls`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from ead_llm.core.request import Prompt
from ead_llm.core.validation import check_text

PromptFormat = Literal["chat", "text"]
ROLES = ("system", "user", "assistant", "tool")
Message = tuple[str, str] | dict[str, Any]
FALLBACK_TEMPLATE = "{Role}: {content}\n\n"
"""One turn of the fallback chat format; the prompt ends with ``Assistant:``."""


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as dicts (``role``, ``content``, and ``tool_calls``/``tool_call_id`` where given), checked:
    known roles, string texts, at least one message."""
    out = []
    for item in messages:
        message = dict(item) if isinstance(item, dict) else {"role": item[0], "content": item[1]}
        role, text = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message role must be one of {ROLES}, got {role!r}")
        if text is None and message.get("tool_calls"):
            text = ""
        if not isinstance(text, str):
            raise ValueError(f"message text must be a string, got {type(text).__name__}")
        message["content"] = check_text("message text", text)
        for call in message.get("tool_calls") or ():
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError(f"a tool call needs a name and arguments, got {call!r}")
        out.append(message)
    if not out:
        raise ValueError("a conversation needs at least one message")
    return out


_NATIVE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_PROBE = {"type": "function", "function": {"name": "ead_llm_probe_tool", "parameters": {"type": "object"}}}


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template writes the ``tools=`` it is given."""
    if not has_chat_template(tokenizer):
        return False
    try:
        return _NATIVE[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[_PROBE], tokenize=False)
        native = "ead_llm_probe_tool" in str(text)
    except Exception:
        native = False
    with contextlib.suppress(TypeError):  # a tokenizer that takes no weak reference is probed each time
        _NATIVE[tokenizer] = native
    return native


def _uses_tools(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> bool:
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the shape chat templates expect for tool calls (``function`` with dict arguments)."""
    out = []
    for m in messages:
        message = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in m["tool_calls"]
            ]
        if m["role"] == "tool":
            message["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                message["name"] = m["name"]
        out.append(message)
    return out


def with_instruction(messages: list[dict[str, Any]], instruction: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``instruction`` appended to the first system message (or a system message first)."""
    if not instruction:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{instruction}"}, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def plain_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """``(role, text)`` turns with tools, calls and replies written as text (Hermes format)."""
    from ead_llm.adapters.tool_calls import assistant_text, tool_result_text, tools_instruction

    turns = []
    for m in messages:
        if m["role"] == "tool":
            turns.append(("user", tool_result_text(m["content"])))
        elif m.get("tool_calls"):
            turns.append((m["role"], assistant_text(m["content"], m["tool_calls"])))
        else:
            turns.append((m["role"], m["content"]))
    if tools:
        instruction = tools_instruction(list(tools))
        if turns and turns[0][0] == "system":
            turns[0] = ("system", f"{turns[0][1]}\n\n{instruction}")
        else:
            turns.insert(0, ("system", instruction))
    return turns


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def fallback_chat_text(messages: Sequence[tuple[str, str]]) -> str:
    """The plain chat format for tokenizers without a template."""
    turns = "".join(FALLBACK_TEMPLATE.format(Role=role.capitalize(), content=text) for role, text in messages)
    return turns + "Assistant:"


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """A rendered prompt as text (token ids decoded)."""
    return prompt if isinstance(prompt, str) else str(tokenizer.decode(list(prompt)))


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    fmt: PromptFormat,
    tools: Sequence[dict[str, Any]] | None = None,
    instruction: str | None = None,
) -> Prompt:
    """The prompt (text, or token ids from a chat template) for ``messages`` in format ``fmt``, offering
    ``tools`` (OpenAI function specs) when given, with ``instruction`` added to the system text."""
    checked = with_instruction(check_messages(messages), instruction)
    if fmt not in ("chat", "text"):
        raise ValueError(f"prompt_format must be 'chat' or 'text', got {fmt!r}")
    with_tools = _uses_tools(checked, tools)
    if fmt == "chat" and with_tools and renders_tools(tokenizer):
        ids = tokenizer.apply_chat_template(
            native_messages(checked),
            tools=list(tools or []) or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return [int(t) for t in ids]  # type: ignore[arg-type]
    turns = plain_messages(checked, tools) if with_tools else [(m["role"], m["content"]) for m in checked]
    if fmt == "text":
        return "\n\n".join(text for _, text in turns)
    if not has_chat_template(tokenizer):
        return fallback_chat_text(turns)
    conversation = [{"role": role, "content": text} for role, text in turns]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]  # type: ignore[arg-type]
