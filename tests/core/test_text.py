import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ead_llm.core.output import IncrementalDetokenizer, StopMatcher, first_stop, held_suffix, text_of
from ead_llm.testing.tiny import byte_bpe_tokenizer, char_tokenizer
from tests.tiny_pairs import BPE_CORPUS


@pytest.fixture(scope="module")
def bpe():
    return byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)


@pytest.mark.parametrize("text", ["café 🙂 数学 ∑", "a  b\n\tc", "🙂🙂", "The fox, naïve."])
def test_detokenizer_rebuilds_multibyte_text(bpe, text: str) -> None:
    ids = bpe.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 4  # several tokens, some inside characters
    detok = IncrementalDetokenizer(bpe, bpe.encode("prefix ", add_special_tokens=False))
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_holds_partial_character_until_complete(bpe) -> None:
    ids = bpe.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(bpe)
    assert [detok.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🙂"


def test_detokenizer_flushes_incomplete_character(bpe) -> None:
    ids = bpe.encode("🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe)
    detok.push(ids[0])
    assert detok.flush() == "\ufffd"


def test_detokenizer_char_level_skips_special_tokens() -> None:
    tok = char_tokenizer()
    ids = [*tok.encode("12 +3", add_special_tokens=False), tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    assert [detok.push(t) for t in ids] == ["1", "2", " ", "+", "3", ""]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 319), max_size=12), st.booleans())
def test_fast_decode_is_the_tokenizers_own(bpe, ids: list[int], clean_up: bool) -> None:
    """The detokenizer's shortcut to the Rust backend gives what ``tokenizer.decode`` gives (special tokens,
    partial characters and all), and is not taken where the wrapper would clean up spaces."""
    bpe.clean_up_tokenization_spaces = clean_up
    try:
        assert text_of(bpe)(ids) == bpe.decode(ids, skip_special_tokens=True)
        assert (text_of(bpe).__name__ == "wrapped") is clean_up
    finally:
        bpe.clean_up_tokenization_spaces = False


def test_fast_decode_is_not_taken_past_a_subclass_that_decodes_its_own_way(bpe) -> None:
    """A tokenizer class that overrides ``_decode`` keeps its own text (the shortcut would skip it)."""

    class Shouting(type(bpe)):  # type: ignore[misc]
        def _decode(self, token_ids: list[int], **kwargs: object) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    bpe.__class__ = Shouting
    try:
        ids = bpe.encode("the fox", add_special_tokens=False)
        assert text_of(bpe)(ids) == "THE FOX" == bpe.decode(ids, skip_special_tokens=True)
    finally:
        bpe.__class__ = Shouting.__mro__[1]


def test_first_stop_prefers_earliest_end() -> None:
    assert first_stop("abcd", ["abcd", "bc"]) == 1
    assert first_stop("xxabyy", ["ab", "xab"]) == 1  # same end: the longer one
    assert first_stop("hello", ["z"]) is None


def test_held_suffix() -> None:
    assert held_suffix("abc##", ["###"]) == 2
    assert held_suffix("abc", ["cde", "bcx"]) == 2
    assert held_suffix("abc", ["x"]) == 0


def test_stop_across_pieces_never_returned() -> None:
    matcher = StopMatcher(["\n\n", "####"])
    out = [matcher.push(p) for p in ["ans", "wer #", "#", "#", "#", " 42"]]
    assert "".join(out) == "answer "
    assert matcher.matched
    assert matcher.push("more") == ""


def test_partial_stop_is_released_when_it_breaks() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("ab ST") == "ab "
    assert matcher.push("OX") == "STOX"
    assert matcher.push("S") == ""
    assert matcher.flush() == "S"
    assert not matcher.matched


def reference_cut(text: str, stops: list[str]) -> str:
    """Cut at the stop completed first in a left-to-right scan (earliest end, then earliest start)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)]
    return text


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab#\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
)
def test_stop_matcher_matches_reference_for_any_split(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pieces)
    if not matcher.matched:
        out += matcher.flush()
    assert out == reference_cut(text, stops)


def pieces_both_ways(
    tokenizer, context: list[int], ids: list[int], clone_at: int | None = None
) -> tuple[list[str], list[str]]:
    """Each token's piece, then the flush, from the backend's stream and from the Python steps (a clone taken
    after ``clone_at`` tokens carries on in the first list)."""
    from ead_llm.core import output

    runs = []
    for streamed in (True, False):
        output.STREAMED = streamed
        try:
            detok = IncrementalDetokenizer(tokenizer, context)
            assert streamed or detok._stream is None
            pieces = []
            for n, token in enumerate(ids):
                if n == clone_at:
                    detok = detok.clone()
                pieces.append(detok.push(token))
            runs.append([*pieces, detok.flush()])
        finally:
            output.STREAMED = True
    return runs[0], runs[1]


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 319), max_size=8),
    ids=st.lists(st.integers(0, 319), max_size=24),
    clone_at=st.none() | st.integers(0, 24),
)
def test_the_backends_stream_gives_the_python_steps_pieces(bpe, context, ids, clone_at) -> None:
    """Any ids (special tokens, bytes inside characters, any context), a clone anywhere: the same piece for every
    token and the same flush, whichever way the detokenizer steps."""
    streamed, python = pieces_both_ways(bpe, context, ids, clone_at)
    assert streamed == python


def test_the_python_steps_take_over_a_sequence_whose_stream_fails(bpe, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that refuses a window (the backend's InvalidPrefix) hands the sequence to the Python steps, which
    carry on from the same windows."""
    text = "café 🙂 数学 ∑ the fox"
    ids = bpe.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe, bpe.encode("prefix ", add_special_tokens=False))
    pieces = [detok.push(t) for t in ids[:5]]

    class Refusing:
        def step(self, backend, token):
            raise Exception("InvalidPrefix")

    detok._stream = Refusing()  # type: ignore[assignment]
    pieces += [detok.push(t) for t in ids[5:]]
    assert detok._stream is None
    assert "".join(pieces) + detok.flush() == text


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_a_sequence_ending_inside_a_character_keeps_its_last_bytes(bpe, stops: tuple[str, ...]) -> None:
    """The last token flushes what the detokenizer held (an incomplete character as U+FFFD, as ``decode`` gives it),
    with stop strings or without."""
    from ead_llm.core.output import OutputProcessor

    ids = bpe.encode("ab 🙂", add_special_tokens=False)[:-1]
    whole = bpe.decode(ids, skip_special_tokens=True)
    assert whole.endswith("\ufffd")
    processor = OutputProcessor(bpe, [], stops)
    assert "".join(processor.push(t, last=n == len(ids) - 1) for n, t in enumerate(ids)) == whole
