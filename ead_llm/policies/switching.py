"""The switching family: EAD, Entropy Adaptive Decoding (arXiv 2502.06833), and its decoder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ead_llm.core.policy import Decoder, ForkRoom, Policy, SequenceView
from ead_llm.core.types import Action, Read, Role, TokenSample, quick_init
from ead_llm.core.validation import check_float, check_int


@quick_init
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

    Unpublished choices (ours): the sequence starts on ``start_on`` (small by default); the window
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
        if since >= self.min_dwell:
            target = ead_target(rolling_mean(window), self.threshold)
            if target is not state.active:
                return EADState(active=target, since_switch=0, window=() if self.reset_window_on_switch else window)
        return EADState(state.active, since, window)

    def counters(self) -> tuple[str, ...]:
        return ("withheld_tokens",) if self.lookahead else ()

    def withhold(self, state: EADState, role: Role, entropy: float) -> EADState | None:
        if not self.lookahead or role is Role.LARGE:
            return None
        after = self.advance(state, role, entropy)  # the decision EAD would take after this token...
        return after if after.active is Role.LARGE else None  # ...taken before it, for this token


class SwitchingDecoder(Decoder):
    """The switching family (EAD, one-model policies, the switching controls): each token comes from the
    model the policy chooses, and the policy advances on that token's entropy.

    A policy's ``withhold`` (EAD's lookahead) may withhold a sampled token, so that the other model
    writes its position at the next step; the withheld pass's work is billed with that token.
    """

    reads_logits: ClassVar[bool] = False

    def __init__(self, policy: Policy, state: Any) -> None:
        self.policy, self.state = policy, state
        self.withheld = 0

    def read(self, seq: SequenceView) -> Read:
        role = self.policy.choose(self.state)
        return _READS.get(role) or Read(role)

    def on_token(self, seq: SequenceView, sample: TokenSample, room: ForkRoom) -> list[Action]:
        revised = self.policy.withhold(self.state, sample.role, sample.entropy)
        if revised is not None and self.policy.choose(revised) is not sample.role:
            self.state = revised
            self.withheld += 1
            return []
        self.state = self.policy.advance(self.state, sample.role, sample.entropy)
        counters = (("withheld_tokens", self.withheld),) if self.withheld else ()
        self.withheld = 0
        return [self.emit(sample, counters)]

    def copy(self) -> SwitchingDecoder:
        """The same policy state (a branched path continues from here)."""
        return SwitchingDecoder(self.policy, self.state)


_READS = {role: Read(role) for role in Role}
"""The two reads a switching decoder asks for (reads are frozen: one of each serves every row and step)."""

Policy.default_family = SwitchingDecoder
