"""The arithmetic of a policy search, free of DSPy and models: scores, floors, bounds and prices."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from ead_llm.policies.switching import EAD

CostUnit = Literal["large_tokens", "usd", "wall"]
COST_KEYS: dict[str, str] = {"large_tokens": "large_tokens", "usd": "cost_usd", "wall": "wall_time_s"}
"""The cost dict's key each unit sums."""


def check_score(value: Any) -> float:
    """A metric's value as a number in [0, 1] (bools count 0 or 1); ValueError naming the fix otherwise."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and not math.isnan(value) and 0.0 <= value <= 1.0:
        return float(value)
    raise ValueError(
        f"the metric returned {value!r}: PolicyOptimizer needs a bool or a number in [0, 1] per example (a floor "
        "and its early stops are shares of the best score); scale the metric or return a bool"
    )


def price(bills: Iterable[dict[str, Any]], unit: CostUnit) -> float:
    """What ``bills`` (cost dicts) cost in ``unit``; ValueError when a bill has no price in it (``usd`` needs
    ``pricing=`` on the LM)."""
    key = COST_KEYS[unit]
    total = 0.0
    for bill in bills:
        if key not in bill:
            raise ValueError(f"a call's bill has no {key!r}: cost='usd' needs the LM's pricing= (ead_llm.Pricing)")
        total += float(bill[key])
    return total


def cannot_reach(scores: Sequence[float], total: int, floor: float) -> bool:
    """Whether a configuration scored ``scores`` on the first of ``total`` examples can no longer reach a mean of
    ``floor``, even if it scores 1 on every example left."""
    best = sum(scores) + (total - len(scores))
    return best < floor * total - 1e-9


def floor_of(baseline: float, max_drop: float) -> float:
    """The lowest mean score a configuration may keep: ``max_drop`` below the baseline's."""
    return baseline - max_drop


def sum_bills(bills: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Counts summed over bills: every numeric key but the shares (recomputed: ``large_fraction``)."""
    out: dict[str, float] = {}
    for bill in bills:
        for key, value in bill.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "large_fraction":
                out[key] = out.get(key, 0) + value
    completion = out.get("completion_tokens", 0)
    out["large_fraction"] = out.get("large_tokens", 0) / completion if completion else 0.0
    return out


def policy_text(policy: dict[str, Any]) -> str:
    """A policy's description (``describe_policy``) as one line: ``ead(threshold=0.1, window=1, ...)``."""
    name = policy.get("policy", "?")
    settings = ", ".join(f"{k}={v}" for k, v in policy.items() if k != "policy")
    return f"{name}({settings})"


def candidate(threshold: float, *, lookahead: bool) -> EAD:
    """EAD with lookahead (window 1, dwell 1: the large model writes exactly the tokens the small one is unsure
    of) or as published (window 5, dwell 10), at ``threshold``."""
    if lookahead:
        return EAD(threshold=threshold, window=1, min_dwell=1, lookahead=True)
    return EAD(threshold=threshold)
