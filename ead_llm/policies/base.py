"""Decoding policies: each decides, token by token, which model of the pair speaks.

A policy is a frozen settings object with pure transitions over an explicit per-sequence state:
``start()`` gives the state before the first token (``start_sequence(key)`` when the state may
depend on which sequence it is), ``choose(state)`` names the model that
produces the next token, and ``advance(state, role, entropy)`` returns the state after that
model emitted a token whose distribution had ``entropy`` bits (raw logits, before temperature).
Policies never run models and never write to the ledger.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from ead_llm.core.types import Role


class Policy(ABC):
    """Base class of every policy; subclasses are frozen dataclasses."""

    name: ClassVar[str]

    @abstractmethod
    def start(self) -> Any:
        """State of a sequence before its first generated token."""

    def start_sequence(self, key: int) -> Any:
        """State of one sequence before its first token; ``key`` identifies the sequence (a hash of
        its prompt and sample stream), for policies whose choices vary per sequence. Default: ``start()``."""
        return self.start()

    @abstractmethod
    def choose(self, state: Any) -> Role:
        """The model that produces the next token."""

    @abstractmethod
    def advance(self, state: Any, role: Role, entropy: float) -> Any:
        """State after ``role`` emitted a token whose distribution had ``entropy`` bits."""

    def preempt(self, state: Any, role: Role, entropy: float) -> Any | None:
        """Before ``role``'s next token is sampled, given its distribution's entropy (bits): a new state
        to withhold that token, so that the model the new state chooses (another one) writes this
        position instead; None to emit it. Default: None."""
        return None

    def describe(self) -> dict[str, Any]:
        """Name and settings, for logs and results."""
        return {"policy": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}


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


def check_policy(value: Any, name: str = "policy") -> Policy:
    """Return ``value`` if it is a policy object, else raise a ``ValueError`` that says what to pass."""
    if not isinstance(value, Policy):
        raise ValueError(
            f"{name} must be a policy object such as EAD(threshold=0.25), SmallOnly() or LargeOnly(), got {value!r}"
        )
    return value


def _policy_classes() -> dict[str, type[Policy]]:
    found: dict[str, type[Policy]] = {}
    pending = list(Policy.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        name = getattr(cls, "name", None)
        if isinstance(name, str):
            found[name] = cls
    return found


def policy_from_description(description: dict[str, Any]) -> Policy:
    """Rebuild a policy from :func:`describe_policy`'s output (for saved programs and configs)."""
    if not isinstance(description, dict) or "policy" not in description:
        raise ValueError(f"a policy description is a dict with a 'policy' name, got {description!r}")
    classes = _policy_classes()
    settings = dict(description)
    name = settings.pop("policy")
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(classes)}")
    for key, value in settings.items():
        if value == "inf":
            settings[key] = math.inf
    return classes[name](**settings)


def policy_tag(policy: Policy) -> str:
    """Compact one-line name of a policy and its settings: ``ead(threshold=0.05,window=5,...)``."""
    settings = describe_policy(policy)
    name = settings.pop("policy")
    return f"{name}({','.join(f'{k}={v}' for k, v in settings.items())})"
