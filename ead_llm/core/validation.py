"""Argument checks shared by every public entry point; each error names the parameter."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def _bounds(minimum: float | None, maximum: float | None, *, exclusive_minimum: bool = False) -> str:
    """The allowed range in words: `` >= 1``, `` in [0, 1]``, `` in (0, 1]``, or nothing."""
    if minimum is not None and maximum is not None:
        return f" in {'(' if exclusive_minimum else '['}{minimum}, {maximum}]"
    if minimum is not None:
        return f" {'>' if exclusive_minimum else '>='} {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) within the bounds, else raise a ``ValueError``
    that names the parameter, the value and the allowed range."""
    allowed = _bounds(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer{allowed}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be{allowed}, got {value}")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    allow_inf: bool = False,
) -> float:
    """Return ``float(value)`` if it is a real number within the bounds, else raise a ``ValueError``
    that names the parameter, the value and the allowed range."""
    allowed = _bounds(minimum, maximum, exclusive_minimum=exclusive_minimum)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number{allowed}, got {value!r}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"{name} must be a number{allowed}, got NaN")
    if math.isinf(number) and not (allow_inf and number > 0):
        raise ValueError(f"{name} must be finite{allowed}, got {number}")
    below = minimum is not None and (number <= minimum if exclusive_minimum else number < minimum)
    if below or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be{allowed}, got {number}")
    return number


def check_stop(value: Any) -> tuple[str, ...]:
    """Normalise a stop argument (None, a string, or a list of strings) to a tuple of strings."""
    if value is None:
        return ()
    items: Iterable[Any] = (value,) if isinstance(value, str) else value
    try:
        stops = tuple(items)
    except TypeError:
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}") from None
    for item in stops:
        if not isinstance(item, str):
            raise ValueError(f"stop must contain only strings, got {item!r}")
        if item == "":
            raise ValueError(f"stop strings must not be empty, got {list(stops)!r}")
    return stops


def check_text(name: str, value: str) -> str:
    """Return ``value`` if it is encodable text; a lone surrogate (which no tokenizer can encode) is
    refused with its position."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name} must be valid Unicode text: it has a lone surrogate {value[err.start]!r} at index {err.start} "
            "(decode bytes with errors='replace' or remove it)"
        ) from None
    return value
