"""Tiny random pairs for tests that cannot take pytest fixtures (the langchain-tests suites' params)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from ead_llm.testing.tiny import build_tiny_pair, byte_bpe_tokenizer

BPE_CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12 + 35 = 47.",
    "Entropy adaptive decoding switches models: café, naïve, 数学, 🙂 and ∑ symbols.",
    "def add(a, b):\n    return a + b\n",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A minimal chat template, so that the chat-template path runs (the pair's own, not the fallback)."""


@functools.cache
def chat_pair() -> tuple[str, str]:
    """A random GPT-2 pair with a byte-level BPE tokenizer that carries a chat template."""
    folder = Path(tempfile.mkdtemp(prefix="ead-llm-chat-pair-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    tokenizer = byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)
    tokenizer.chat_template = CHAT_TEMPLATE
    small, large = build_tiny_pair(folder, family="gpt2", tokenizer=tokenizer, seed=5, max_positions=2048)
    return str(small), str(large)
