"""The policies every family shares (SmallOnly, LargeOnly), and naming, describing and rebuilding policies.

The contract itself (:class:`Policy`, :class:`Decoder` and what they exchange) is in :mod:`ead_llm.core.policy`
and :mod:`ead_llm.core.types`; it is re-exported here. The families are :mod:`ead_llm.policies.switching` (EAD,
the baselines and controls), :mod:`ead_llm.policies.speculative` (draft-and-verify) and
:mod:`ead_llm.policies.eager` (branching).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ead_llm.core.policy import Decoder, ForkRoom, Policy, SequenceView, check_policy
from ead_llm.core.types import DraftRound, Read, Role, RoundVerdict, TokenSample

__all__ = [
    "Decoder",
    "DraftRound",
    "ForkRoom",
    "LargeOnly",
    "Policy",
    "Read",
    "RoundVerdict",
    "SequenceView",
    "SingleModelState",
    "SmallOnly",
    "TokenSample",
    "canonical_policy_name",
    "check_policy",
    "describe_policy",
    "normalized_policy_name",
    "policy_from_description",
    "policy_tag",
]


@dataclass(frozen=True)
class SingleModelState:
    """State of a policy that always uses one model (nothing changes)."""


@dataclass(frozen=True)
class SmallOnly(Policy):
    """Every token from the small model."""

    name: ClassVar[str] = "small_only"

    def start(self) -> SingleModelState:
        return SingleModelState()

    def choose(self, state: SingleModelState) -> Role:
        return Role.SMALL

    def advance(self, state: SingleModelState, role: Role, entropy: float) -> SingleModelState:
        return state


@dataclass(frozen=True)
class LargeOnly(Policy):
    """Every token from the large model."""

    name: ClassVar[str] = "large_only"

    def start(self) -> SingleModelState:
        return SingleModelState()

    def choose(self, state: SingleModelState) -> Role:
        return Role.LARGE

    def advance(self, state: SingleModelState, role: Role, entropy: float) -> SingleModelState:
        return state


def describe_policy(policy: Policy) -> dict[str, Any]:
    """JSON-friendly description of a policy (enum values as strings, inf as a string)."""
    out: dict[str, Any] = {}
    for key, value in policy.describe().items():
        if isinstance(value, Role):
            value = value.value
        elif isinstance(value, float) and math.isinf(value):
            value = "inf"
        out[key] = value
    return out


def _policy_classes() -> dict[str, type[Policy]]:
    """Every policy by name (the package imports each family, and each policy class registers itself)."""
    return Policy.registry


POLICY_ALIASES = {
    "small": "small_only",
    "large": "large_only",
    "smallonly": "small_only",
    "largeonly": "large_only",
    "spec": "speculative",
    "speculative_decoding": "speculative",
    "random": "random_switching",
    "fixed": "fixed_block",
}
"""Other spellings of policy names, accepted everywhere (CLI, server, descriptions); the canonical name is the
one ``describe_policy`` writes."""


def normalized_policy_name(name: str) -> str:
    """``name`` with its alias resolved (any case, ``-`` for ``_``), not checked against the policies."""
    if not isinstance(name, str):
        raise ValueError(f"a policy name is a string, got {name!r}")
    key = name.strip().lower().replace("-", "_")
    return POLICY_ALIASES.get(key, key)


def canonical_policy_name(name: str) -> str:
    """The canonical name of a policy spelled ``name`` (an alias, any case, ``-`` for ``_``)."""
    key = normalized_policy_name(name)
    if key not in _policy_classes():
        known = sorted({*_policy_classes(), *POLICY_ALIASES})
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(known)}")
    return key


def policy_from_description(description: dict[str, Any]) -> Policy:
    """Rebuild a policy from :func:`describe_policy`'s output (for saved programs and configs); the name may
    be an alias (``large`` for ``large_only``)."""
    if not isinstance(description, dict) or "policy" not in description:
        raise ValueError(f"a policy description is a dict with a 'policy' name, got {description!r}")
    classes = _policy_classes()
    settings = dict(description)
    name = canonical_policy_name(settings.pop("policy"))
    for key, value in settings.items():
        if value == "inf":
            settings[key] = math.inf
        elif isinstance(value, dict) and "policy" in value:  # a nested policy (EAGER's decoder)
            settings[key] = policy_from_description(value)
    return classes[name](**settings)


def policy_tag(policy: Policy) -> str:
    """Compact one-line name of a policy and its settings: ``ead(threshold=0.05,window=5,...)``."""
    settings = describe_policy(policy)
    name = settings.pop("policy")
    return f"{name}({','.join(f'{k}={v}' for k, v in settings.items())})"
