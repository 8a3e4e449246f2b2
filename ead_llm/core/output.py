"""The output processor: token ids -> text, stop strings across tokens, the finish reason.

It runs off the model's hot path: after a step, on the scheduler thread for sequences whose end
depends on their text (stop strings) or whose paths branch, and otherwise on the caller's thread
as it reads its events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

REPLACEMENT_CHAR = "\ufffd"


class TextDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (not a policy's decoder)."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,  # noqa: FBT001 (transformers' signature)
        **kwargs: Any,
    ) -> str | list[str]: ...


def text_of(tokenizer: TextDecoder) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True)``: straight to a fast tokenizer's Rust
    backend when transformers' wrapper would only pass the call on (its own ``decode``, no clean-up of spaces),
    which is most of a decode's cost for one token (this runs twice per generated token)."""
    kind = type(tokenizer)
    plain = (
        issubclass(kind, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    )
    if plain:
        decode = tokenizer.backend_tokenizer.decode  # type: ignore[attr-defined]
        return lambda ids: decode(ids, skip_special_tokens=True)

    def wrapped(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    return wrapped


class IncrementalDetokenizer:
    """Turns generated token ids into text pieces, one call per token.

    Each new piece is the difference between decoding a short window that ends at the new token
    and the same window without it, so that tokenizers which drop a leading space or emit a
    partial UTF-8 character on their own still give exact text. A piece is released only once
    it no longer ends in an incomplete character.
    """

    def __init__(
        self, tokenizer: TextDecoder, context: Sequence[int] = (), *, text: Callable[[list[int]], str] | None = None
    ) -> None:
        """``text``: :func:`text_of` ``tokenizer``, when the caller has it already."""
        self._tokenizer = tokenizer
        self._decode = text or text_of(tokenizer)
        self._ids: list[int] = list(context[-6:])
        self._prefix = 0
        self._read = len(self._ids)

    def clone(self) -> IncrementalDetokenizer:
        """An independent copy sharing the tokenizer (a branched path continues from the same state)."""
        twin = IncrementalDetokenizer(self._tokenizer, text=self._decode)
        twin._ids, twin._prefix, twin._read = list(self._ids), self._prefix, self._read
        return twin

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text still held at the end of the sequence (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Start index of the stop string that is completed first in ``text`` (earliest end), or None.

    Among stops ending at the same place, the longer one (earlier start) wins.
    """
    best: tuple[int, int] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), start)
            if best is None or key < best:
                best = key
    return None if best is None else best[1]


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StopMatcher:
    """Releases streamed text while holding back anything that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.matched = False

    def push(self, piece: str) -> str:
        """Add a piece; return the text that is safe to release. Sets ``matched`` on a stop."""
        if self.matched:
            return ""
        buffer = self._held + piece
        start = first_stop(buffer, self._stops)
        if start is not None:
            self.matched = True
            self._held = ""
            return buffer[:start]
        keep = held_suffix(buffer, self._stops)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def clone(self) -> StopMatcher:
        """An independent copy (a branched path continues from the same held text)."""
        twin = StopMatcher(self._stops)
        twin._held, twin.matched = self._held, self.matched
        return twin

    def flush(self) -> str:
        """Release what is held when the sequence ends without a stop."""
        held, self._held = self._held, ""
        return held


class OutputProcessor:
    """One sequence's text: incremental detokenization, then stop strings."""

    def __init__(self, tokenizer: TextDecoder, context: Sequence[int], stops: Sequence[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, context)
        self._stops = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        """A stop string has been completed (nothing more is released)."""
        return self._stops.matched

    def push(self, token_id: int, *, last: bool) -> str:
        """The text ``token_id`` releases; with ``last`` (the sequence ends here) everything still held.

        A stop string completed by the token (or by the text held until the end) sets ``stopped``.
        """
        text = self._stops.push(self._detok.push(token_id))
        if last and not self._stops.matched:
            text += self._stops.push(self._detok.flush())
            if not self._stops.matched:
                text += self._stops.flush()
        return text

    def clone(self) -> OutputProcessor:
        """An independent copy (a branched path continues from the same text state)."""
        twin = object.__new__(OutputProcessor)
        twin._detok, twin._stops = self._detok.clone(), self._stops.clone()
        return twin
