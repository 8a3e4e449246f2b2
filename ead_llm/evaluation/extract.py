"""Answer extractors: the final answer of an output text, for scoring (the bench) and voting (EAGER).

Each takes the text and returns the answer as a string, or None when the text has none.
``auto`` tries the common formats in turn and falls back on the text's last line, so that any
output votes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

Extract = Callable[[str], str | None]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_CHOICE = re.compile(r"(?:^|[^A-Za-z])\(?([A-E])\)?(?=$|[^A-Za-z])")


def extract_hashes(text: str) -> str | None:
    """What follows the first ``####`` on its line (GSM8K's and the embedded task's format); just
    the number when the line starts with one (``#### 72 dollars`` -> ``72``)."""
    match = _HASHES.search(text)
    if match is None:
        return None
    rest = match.group(1).strip()
    number = _NUMBER.match(rest)
    return number.group(0) if number else rest or None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (thousands separators allowed)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_first_line(text: str) -> str | None:
    """The first non-empty line."""
    return next((line.strip() for line in text.splitlines() if line.strip()), None)


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip() or None
            depth -= 1
    return None


def extract_choice(text: str) -> str | None:
    """The first standalone option letter A-E (``B``, ``(B)``, ``answer: B``)."""
    match = _CHOICE.search(text)
    return match.group(1) if match else None


def extract_exact(text: str) -> str | None:
    """The whole output, stripped."""
    return text.strip() or None


def extract_final_answer(text: str) -> str | None:
    """``auto``: the ``####`` answer, else the last ``\\boxed{}``, else the last number, else the last
    non-empty line (whitespace collapsed, case folded, trailing punctuation dropped); normalised, so
    ``1,000`` and ``1000.0`` vote together. None only for an empty text."""
    for extract in (extract_hashes, extract_boxed, extract_last_number):
        found = extract(text)
        if found:
            return normalize(found)
    line = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return " ".join(line.split()).casefold().rstrip(".!?;:,") or None


EXTRACTORS: dict[str, Extract] = {
    "auto": extract_final_answer,
    "hashes": extract_hashes,
    "last_number": extract_last_number,
    "first_line": extract_first_line,
    "boxed": extract_boxed,
    "choice": extract_choice,
    "exact": extract_exact,
}


def contains_answer(text: str, answer: str) -> bool:
    """Whether ``answer`` occurs in ``text`` as a whole word or phrase, ignoring case and runs of
    whitespace (``"Tokyo"`` is in ``"The capital of Japan is Tokyo."``, ``"Rome"`` is not in
    ``"Romeo"``). For short factual answers a model states inside a sentence."""
    words = answer.split()
    if not words:
        return False
    phrase = r"\s+".join(re.escape(word) for word in words)
    return re.search(rf"(?<!\w){phrase}(?!\w)", text, flags=re.IGNORECASE) is not None


def normalize(answer: str) -> str:
    """Canonical form for comparison: numbers by value (``1,000.0`` == ``1000``), other text stripped."""
    text = answer.strip()
    candidate = text.replace(",", "").rstrip(".")
    try:
        value = Decimal(candidate)
    except InvalidOperation:
        return text
    if not value.is_finite():
        return text
    return format(value.normalize(), "f") if value != value.to_integral_value() else str(int(value))
