"""Argument checks shared by every public entry point; each error names the parameter."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) within the bounds, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
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
    """Return ``float(value)`` if it is a real number within the bounds, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"{name} must be a number, got NaN")
    if math.isinf(number) and not (allow_inf and number > 0):
        raise ValueError(f"{name} must be finite, got {number}")
    if minimum is not None:
        if exclusive_minimum and number <= minimum:
            raise ValueError(f"{name} must be > {minimum}, got {number}")
        if not exclusive_minimum and number < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
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
            raise ValueError("stop strings must not be empty")
    return stops
