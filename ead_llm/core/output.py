"""The output processor: token ids -> text, stop strings across tokens, the finish reason.

It runs off the model's hot path: after a step, on the scheduler thread for sequences whose end
depends on their text (stop strings) or whose paths branch, and otherwise on the caller's thread
as it reads its events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

REPLACEMENT_CHAR = "\ufffd"
STREAMED = True
"""Detokenize through the backend's ``DecodeStream`` where there is one (:class:`IncrementalDetokenizer`); False:
the Python steps everywhere (tests compare the two)."""


def _stream(backend: Any, released: list[int]) -> DecodeStream | None:
    """A backend stream whose last released window is ``released`` (its next piece is what follows their text); None
    where their text ends inside a character (the stream would hold those bytes back and release them with the next
    piece, where the Python steps count them as released: the two would differ)."""
    if released and backend.decode(released, skip_special_tokens=True).endswith(REPLACEMENT_CHAR):
        return None
    return DecodeStream(ids=released, skip_special_tokens=True)


class TextDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (not a policy's decoder)."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,  # noqa: FBT001 (transformers' signature)
        **kwargs: Any,
    ) -> str | list[str]: ...


def backend_of(tokenizer: TextDecoder) -> Any | None:
    """A fast tokenizer's Rust backend (``tokenizers.Tokenizer``) when transformers' wrapper would only pass a decode
    on to it (its own ``decode``, no clean-up of spaces), else None."""
    kind = type(tokenizer)
    plain = (
        issubclass(kind, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    )
    return tokenizer.backend_tokenizer if plain else None  # type: ignore[attr-defined]


def text_of(tokenizer: TextDecoder) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True)``: straight to a fast tokenizer's Rust
    backend where :func:`backend_of` finds one, which is most of a decode's cost for one token."""
    backend = backend_of(tokenizer)
    if backend is not None:
        decode = backend.decode
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

    Where :func:`backend_of` finds a fast tokenizer's backend, each step runs in Rust (its ``DecodeStream``, the same
    windows and rule: 1.8 against 4.7 us a token for SmolLM2's tokenizer); this class keeps the windows' bounds
    beside it, for :meth:`flush`, :meth:`clone`, and the Python steps it falls back to if the stream refuses a window.
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
        self._backend: Any = backend_of(tokenizer) if STREAMED else None
        self._stream = _stream(self._backend, self._ids) if self._backend is not None else None

    def clone(self) -> IncrementalDetokenizer:
        """An independent copy sharing the tokenizer (a branched path continues from the same state)."""
        twin = IncrementalDetokenizer(self._tokenizer, text=self._decode)
        twin._ids, twin._prefix, twin._read = list(self._ids), self._prefix, self._read
        twin._stream = None
        if self._stream is not None:  # the stream's state: the released window, then the held tokens stepped again
            stream = _stream(self._backend, self._ids[self._prefix : self._read])
            if stream is not None:
                for held in self._ids[self._read :]:
                    stream.step(self._backend, held)
            twin._stream = stream
        return twin

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # a window whose text does not extend the one before: this sequence steps in Python
                self._stream = None
            else:
                if piece is not None:
                    self._prefix, self._read = self._read, len(self._ids)
                    return piece
                return ""
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
        if self._stream is not None:
            self._stream = _stream(self._backend, [])
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
        self._unstopped = not stops

    @property
    def stopped(self) -> bool:
        """A stop string has been completed (nothing more is released)."""
        return self._stops.matched

    def push(self, token_id: int, *, last: bool) -> str:
        """The text ``token_id`` releases; with ``last`` (the sequence ends here) everything still held.

        A stop string completed by the token (or by the text held until the end) sets ``stopped``.
        """
        if self._unstopped:  # no stop strings: the detokenizer's pieces as they are
            return self._detok.push(token_id) + self._detok.flush() if last else self._detok.push(token_id)
        text = self._stops.push(self._detok.push(token_id))
        if last and not self._stops.matched:
            text += self._stops.push(self._detok.flush())
            if not self._stops.matched:
                text += self._stops.flush()
        return text

    def clone(self) -> OutputProcessor:
        """An independent copy (a branched path continues from the same text state)."""
        twin = object.__new__(OutputProcessor)
        twin._detok, twin._stops, twin._unstopped = self._detok.clone(), self._stops.clone(), self._unstopped
        return twin
