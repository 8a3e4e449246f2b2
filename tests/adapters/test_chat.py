"""Conversation rendering: chat template, plain fallback, raw text."""

from __future__ import annotations

import pytest

from ead_llm.adapters.prompts import fallback_chat_text, has_chat_template, render
from ead_llm.testing.tiny import byte_bpe_tokenizer
from tests.tiny_pairs import BPE_CORPUS, CHAT_TEMPLATE

TURNS = [("system", "Be brief."), ("user", "12+35="), ("assistant", "47"), ("user", "and 1+1?")]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)


def test_fallback_format() -> None:
    assert fallback_chat_text(TURNS[:2]) == "System: Be brief.\n\nUser: 12+35=\n\nAssistant:"


def test_text_format_joins_raw_and_passes_one_message_through(tokenizer) -> None:
    assert render(tokenizer, [("user", "123+456\n")], "text") == "123+456\n"
    assert render(tokenizer, TURNS[:2], "text") == "Be brief.\n\n12+35="


def test_chat_format_uses_the_template_or_the_fallback(tokenizer) -> None:
    assert not has_chat_template(tokenizer)
    assert render(tokenizer, TURNS, "chat") == fallback_chat_text(TURNS)
    templated = byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)
    templated.chat_template = CHAT_TEMPLATE
    ids = render(templated, TURNS, "chat")
    expected = "".join(f"<|{r}|>{t}\n" for r, t in TURNS) + "<|assistant|>"
    assert isinstance(ids, list) and templated.decode(ids) == expected


@pytest.mark.parametrize(
    ("turns", "fmt", "match"),
    [
        ([("robot", "x")], "chat", "role"),
        ([("user", 3)], "chat", "string"),
        ([], "chat", "at least one"),
        ([("user", "x")], "markdown", "prompt_format"),
    ],
)
def test_bad_conversations_are_refused(tokenizer, turns, fmt, match) -> None:
    with pytest.raises(ValueError, match=match):
        render(tokenizer, turns, fmt)
