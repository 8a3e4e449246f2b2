"""Control policies for evaluating EAD: switching that ignores the text.

- :class:`RandomSwitching`: the sequence is cut into blocks of ``block`` tokens (EAD's
  ``min_dwell`` in the harness); each block goes to the large model with probability
  ``fraction``, so the expected large-token fraction is ``fraction``. Which blocks is a fixed
  function of ``seed``, the sequence's key (its prompt and sample stream) and the block's index,
  so every sequence has its own pattern (the realised fraction over many sequences concentrates
  on ``fraction``) and runs repeat exactly, whatever else is in the batch.
- :class:`FixedBlockSwitching`: a fixed rhythm, ``large_block`` large tokens after every
  ``small_block`` small ones.
- :class:`OracleSwitching`: the large model exactly where the two models' top-1 tokens differ.

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
