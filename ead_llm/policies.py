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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ead_llm.types import Role
from ead_llm.validation import check_float, check_int


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


@dataclass(frozen=True)
class EADState:
    """Per-sequence state of EAD."""

    active: Role
    """The model that produces the next token."""
    since_switch: int
    """Tokens generated since the last switch (or since the start)."""
    window: tuple[float, ...]
    """Entropies (bits) of the most recent tokens, oldest first, at most ``window`` long."""


def rolling_mean(values: Sequence[float]) -> float:
    """Mean of ``values`` (the EAD window); 0 for an empty window."""
    return sum(values) / len(values) if values else 0.0


def ead_target(mean_entropy: float, threshold: float) -> Role:
    """The model EAD wants for a window mean: large strictly above the threshold."""
    return Role.LARGE if mean_entropy > threshold else Role.SMALL


@dataclass(frozen=True)
class EAD(Policy):
    """Entropy Adaptive Decoding (arXiv 2502.06833).

    After each token, append the producing model's entropy (bits) to a window of the last
    ``window`` tokens. Once ``min_dwell`` tokens have been generated since the last switch, the
    next token comes from the large model if the window mean exceeds ``threshold`` and from the
    small model otherwise; before that the active model is kept.

    Unpublished choices (ours): the sequence starts on ``start`` (small by default); the window
    keeps its history across a switch unless ``reset_window_on_switch`` (with the default
    ``window <= min_dwell`` the choice cannot matter, because a decision only happens once the
    window holds tokens of the current model alone).
    """

    name: ClassVar[str] = "ead"

    threshold: float = 0.25
    """Switch threshold on the window mean, in bits (>= 0; inf never uses the large model)."""
    window: int = 5
    """Tokens in the rolling mean (>= 1)."""
    min_dwell: int = 10
    """Tokens to generate after a switch before the next decision (>= 0)."""
    start_on: Role = Role.SMALL
    """Model that produces the first token."""
    reset_window_on_switch: bool = False
    """Forget the window's entropies when the active model changes."""
    lookahead: bool = False
    """(ours) Take the switch-to-large decision one token earlier: the small model's distribution for
    the next token enters the window before its token is sampled, and when the rule then says
    "large", that token is withheld and the large model writes the position. Standard EAD emits it
    and switches after it, so the uncertain token itself is always the small model's."""

    def __post_init__(self) -> None:
        check_float("threshold", self.threshold, minimum=0.0, allow_inf=True)
        check_int("window", self.window, minimum=1)
        check_int("min_dwell", self.min_dwell, minimum=0)
        try:
            object.__setattr__(self, "start_on", Role(self.start_on))
        except ValueError:
            raise ValueError(f"start_on must be 'small' or 'large', got {self.start_on!r}") from None
        if not isinstance(self.reset_window_on_switch, bool):
            raise ValueError(f"reset_window_on_switch must be a bool, got {self.reset_window_on_switch!r}")
        if not isinstance(self.lookahead, bool):
            raise ValueError(f"lookahead must be a bool, got {self.lookahead!r}")

    def start(self) -> EADState:
        return EADState(active=self.start_on, since_switch=0, window=())

    def choose(self, state: EADState) -> Role:
        return state.active

    def advance(self, state: EADState, role: Role, entropy: float) -> EADState:
        window = (*state.window, entropy)[-self.window :]
        since = state.since_switch + 1
        if since < self.min_dwell:
            return replace(state, since_switch=since, window=window)
        target = ead_target(rolling_mean(window), self.threshold)
        if target is state.active:
            return replace(state, since_switch=since, window=window)
        return EADState(active=target, since_switch=0, window=() if self.reset_window_on_switch else window)

    def preempt(self, state: EADState, role: Role, entropy: float) -> EADState | None:
        if not self.lookahead or role is Role.LARGE:
            return None
        after = self.advance(state, role, entropy)  # the decision EAD would take after this token...
        return after if after.active is Role.LARGE else None  # ...taken before it, for this token


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
