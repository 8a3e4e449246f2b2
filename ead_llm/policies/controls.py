"""Control policies for evaluating EAD: switching that ignores the text, and a per-call router.

- :class:`RandomSwitching`: the sequence is cut into blocks of ``block`` tokens (EAD's
  ``min_dwell`` in the harness); each block goes to the large model with probability
  ``fraction``, so the expected large-token fraction is ``fraction``. Which blocks is a fixed
  function of ``seed``, the sequence's key (its prompt and sample stream) and the block's index,
  so every sequence has its own pattern (the realised fraction over many sequences concentrates
  on ``fraction``) and runs repeat exactly, whatever else is in the batch.
- :class:`FixedBlockSwitching`: a fixed rhythm, ``large_block`` large tokens after every
  ``small_block`` small ones.
- :class:`OracleSwitching`: the large model exactly where the two models' top-1 tokens differ.
- :class:`QueryRouter`: a router in the manner of RouteLLM and FrugalGPT, one model per call: the small
  model writes the first ``probe`` tokens, and their mean entropy sends the rest of the call to the large
  model or keeps it on the small one (the anchor a per-token or per-predictor policy must beat).

They answer "is EAD's choice of *where* to spend the large model better than chance at the same
budget?"; they are policies like any other and run on the same engine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ead_llm.core.policy import Policy
from ead_llm.core.types import Role
from ead_llm.core.validation import check_float, check_int
from ead_llm.policies.speculative import SpeculativeDecoding
from ead_llm.policies.switching import ead_target


@dataclass(frozen=True)
class CountState:
    """Tokens generated so far, and which sequence this is (RandomSwitching's pattern)."""

    generated: int = 0
    key: int = 0


def block_draw(seed: int, key: int, block: int) -> float:
    """A uniform number in [0, 1) fixed by ``(seed, sequence key, block)`` (sha256; no global random state)."""
    digest = hashlib.sha256(f"ead-llm-random-switching/{seed}/{key}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class RandomSwitching(Policy):
    """Each block of ``block`` tokens comes from the large model with probability ``fraction``."""

    name: ClassVar[str] = "random_switching"

    fraction: float = 0.25
    """Expected large-token fraction, in [0, 1]."""
    block: int = 10
    """Tokens per block (>= 1): the dwell of the switches."""
    seed: int = 0
    """Which random pattern (>= 0)."""

    def __post_init__(self) -> None:
        check_float("fraction", self.fraction, minimum=0.0, maximum=1.0)
        check_int("block", self.block, minimum=1)
        check_int("seed", self.seed, minimum=0)

    def start(self) -> CountState:
        return CountState()

    def start_sequence(self, key: int) -> CountState:
        return CountState(key=key)

    def choose(self, state: CountState) -> Role:
        draw = block_draw(self.seed, state.key, state.generated // self.block)
        return Role.LARGE if draw < self.fraction else Role.SMALL

    def advance(self, state: CountState, role: Role, entropy: float) -> CountState:
        return replace(state, generated=state.generated + 1)


@dataclass(frozen=True)
class FixedBlockSwitching(Policy):
    """``small_block`` small tokens, then ``large_block`` large ones, repeated."""

    name: ClassVar[str] = "fixed_block"

    small_block: int = 30
    """Small-model tokens per cycle (>= 0)."""
    large_block: int = 10
    """Large-model tokens per cycle (>= 0; the two are not both 0)."""

    def __post_init__(self) -> None:
        check_int("small_block", self.small_block, minimum=0)
        check_int("large_block", self.large_block, minimum=0)
        if self.small_block + self.large_block == 0:
            raise ValueError("small_block and large_block cannot both be 0")

    @property
    def large_fraction(self) -> float:
        return self.large_block / (self.small_block + self.large_block)

    def start(self) -> CountState:
        return CountState()

    def choose(self, state: CountState) -> Role:
        position = state.generated % (self.small_block + self.large_block)
        return Role.SMALL if position < self.small_block else Role.LARGE

    def advance(self, state: CountState, role: Role, entropy: float) -> CountState:
        return replace(state, generated=state.generated + 1)


@dataclass(frozen=True)
class OracleSwitching(SpeculativeDecoding):
    """The oracle: the large model exactly where the two models' top-1 tokens differ.

    Run as one-token speculative rounds: the small model proposes, the large model scores the same
    position, and the small token stands iff both models' most likely tokens agree; otherwise the
    large model's token (its argmax when greedy, else a draw from it) is written. Greedy, its text is
    the large model's, with the fewest large-model tokens any switching could use. Both models read
    every position, so its wall-clock and FLOPs are not a budget to compare against.
    """

    name: ClassVar[str] = "oracle"

    gamma: int = 1
    adaptive_gamma: bool = False
    max_gamma: int = 1

    def __post_init__(self) -> None:
        if self.gamma != 1 or self.adaptive_gamma:
            raise ValueError("OracleSwitching compares one position at a time: gamma must be 1, not adaptive")
        super().__post_init__()

    def rejection_settings(self) -> dict[str, Any]:
        return {"oracle": True}


@dataclass(frozen=True)
class RouterState:
    """Tokens generated, the probe's summed entropy (bits), and the route once the probe is done."""

    generated: int = 0
    entropy: float = 0.0
    route: Role | None = None


@dataclass(frozen=True)
class QueryRouter(Policy):
    """One model per call, chosen by the entropy of its first tokens: the small model writes ``probe`` tokens;
    when their mean entropy exceeds ``threshold`` bits the large model writes the rest, else the small one.
    (The probe's tokens stay: a call routed to the large model is the small model's first ``probe`` tokens
    and the large model's continuation.)"""

    name: ClassVar[str] = "query_router"

    threshold: float = 0.5
    """Mean entropy (bits) of the probe above which the call goes to the large model (>= 0)."""
    probe: int = 8
    """Tokens the small model writes before the call is routed (>= 1)."""

    def __post_init__(self) -> None:
        check_float("threshold", self.threshold, minimum=0.0, allow_inf=True)
        check_int("probe", self.probe, minimum=1)

    def start(self) -> RouterState:
        return RouterState()

    def choose(self, state: RouterState) -> Role:
        return Role.SMALL if state.route is None else state.route

    def advance(self, state: RouterState, role: Role, entropy: float) -> RouterState:
        if state.route is not None:
            return replace(state, generated=state.generated + 1)
        generated, total = state.generated + 1, state.entropy + entropy
        route = ead_target(total / generated, self.threshold) if generated == self.probe else None
        return RouterState(generated=generated, entropy=total, route=route)
