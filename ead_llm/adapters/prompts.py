"""Turning a conversation into the prompt the pair completes.

Two formats, chosen per object (``prompt_format``):

- ``chat``: the tokenizer's own chat template with the generation prompt appended; a tokenizer
  without one gets :data:`FALLBACK_TEMPLATE`'s plain ``Role: text`` turns ending in ``Assistant:``.
- ``text``: a completion model's raw prompt: the messages' texts joined by a blank line, nothing
  added (a single user message is passed through exactly). The embedded pair uses this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from transformers import PreTrainedTokenizerBase

from ead_llm.core.request import Prompt
from ead_llm.core.validation import check_text

PromptFormat = Literal["chat", "text"]
ROLES = ("system", "user", "assistant")
FALLBACK_TEMPLATE = "{Role}: {content}\n\n"
"""One turn of the fallback chat format; the prompt ends with ``Assistant:``."""


def check_messages(messages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(role, text)`` pairs with known roles and string texts, at least one of them."""
    out = []
    for item in messages:
        role, text = item
        if role not in ROLES:
            raise ValueError(f"message role must be one of {ROLES}, got {role!r}")
        if not isinstance(text, str):
            raise ValueError(f"message text must be a string, got {type(text).__name__}")
        out.append((role, check_text("message text", text)))
    if not out:
        raise ValueError("a conversation needs at least one message")
    return out


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def fallback_chat_text(messages: Sequence[tuple[str, str]]) -> str:
    """The plain chat format for tokenizers without a template."""
    turns = "".join(FALLBACK_TEMPLATE.format(Role=role.capitalize(), content=text) for role, text in messages)
    return turns + "Assistant:"


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]], fmt: PromptFormat) -> Prompt:
    """The prompt (text, or token ids from a chat template) for ``messages`` in format ``fmt``."""
    messages = check_messages(messages)
    if fmt == "text":
        return "\n\n".join(text for _, text in messages)
    if fmt != "chat":
        raise ValueError(f"prompt_format must be 'chat' or 'text', got {fmt!r}")
    if not has_chat_template(tokenizer):
        return fallback_chat_text(messages)
    conversation = [{"role": role, "content": text} for role, text in messages]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]  # type: ignore[arg-type]
