"""Draft-and-verify policies: lossless speculative decoding, and EASD's entropy-aware rejection.

A round: the small model drafts up to ``gamma`` tokens (one engine step each, batched with other
sequences' drafts), then the large model scores the last accepted token and every draft in one
pass. :meth:`SpeculativeDecoding.judge` (the rejection sampler) decides how many drafts stand and
draws the round's last token: the correction after a rejection, or a bonus token from the large
model when every draft stood. Rejected positions are rolled back by moving each model's cache
length back (nothing is recomputed). The engine emits the accepted drafts (attributed to the small
model) and the round's last token (the large model) as ordinary token events.

Speculative sampling (Leviathan et al., arXiv 2211.17192): draft ``x`` stands with probability
``min(1, p_L(x) / p_S(x))`` on the two sampling distributions (temperature, top-k, top-p
applied); a rejection resamples from ``norm(max(0, p_L - p_S))``. Greedy (temperature 0): a draft
stands while it is the large model's argmax. The output distribution is the large model's.

EASD (arXiv 2512.23765): a draft that would stand is rejected when both models' entropies (bits,
of the raw logits) exceed ``entropy_threshold`` and their top-``top_n`` token sets overlap by more
than ``overlap_threshold`` (shared fraction of ``top_n``); the token is then drawn from the large
model's distribution with that draft's probability set to zero (greedy: the large model's best
other token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ead_llm.core.ops import (
    acceptance_probability,
    entropy_bits,
    residual_probs,
    sampling_probs,
    top_n_overlap,
    without_token,
)
from ead_llm.core.request import SamplingParams
from ead_llm.core.types import Role
from ead_llm.core.validation import check_float, check_int
from ead_llm.policies.base import Policy


@dataclass(frozen=True)
class SpecState:
    """Where a sequence is in its round."""

    gamma: int
    """Drafts this round (after the engine's length budget)."""
    drafted: int = 0
    """Drafts made so far this round."""
    next_gamma: int = 0
    """Drafts the next round asks for (adaptive gamma moves it)."""


@dataclass(frozen=True)
class Verdict:
    """What the rejection sampler decided for one round."""

    accepted: int
    """Drafts that stand (a prefix of the drafts)."""
    token: int | None
    """The round's last token, drawn from the large model (None: the round ends with its drafts)."""
    entropy_rejections: int = 0
    """1 when EASD rejected a draft that would have stood."""


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass(frozen=True)
class SpeculativeDecoding(Policy):
    """Lossless speculative decoding: the small model drafts ``gamma`` tokens, the large one verifies."""

    name: ClassVar[str] = "speculative"

    gamma: int = 4
    """Drafts per round (>= 1)."""
    adaptive_gamma: bool = False
    """Grow gamma by one after a round where every draft stood, shrink it by one after a rejection."""
    max_gamma: int = 16
    """Upper bound of adaptive gamma."""

    def __post_init__(self) -> None:
        check_int("gamma", self.gamma, minimum=1)
        check_int("max_gamma", self.max_gamma, minimum=self.gamma)
        if not isinstance(self.adaptive_gamma, bool):
            raise ValueError(f"adaptive_gamma must be a bool, got {self.adaptive_gamma!r}")

    def start(self) -> SpecState:
        return SpecState(gamma=self.gamma, next_gamma=self.gamma)

    def choose(self, state: SpecState) -> Role:
        return Role.SMALL if state.drafted < state.gamma else Role.LARGE

    def advance(self, state: SpecState, role: Role, entropy: float) -> SpecState:
        """One draft made."""
        return replace(state, drafted=state.drafted + 1)

    def begin_round(self, state: SpecState, budget: int) -> SpecState:
        """Start a round drafting at most ``budget`` tokens (what the length limits leave)."""
        return replace(state, gamma=max(0, min(state.next_gamma, budget)), drafted=0)

    def cut_round(self, state: SpecState) -> SpecState:
        """Stop drafting now (the last draft ends the text: nothing after it could be kept)."""
        return replace(state, gamma=state.drafted)

    def end_round(self, state: SpecState, drafted: int, accepted: int) -> SpecState:
        """Adaptive gamma: grow after a clean sweep, shrink after a rejection."""
        gamma = state.next_gamma
        if self.adaptive_gamma and drafted:
            gamma = min(self.max_gamma, gamma + 1) if accepted == drafted else max(1, gamma - 1)
        return SpecState(gamma=gamma, drafted=0, next_gamma=gamma)

    def uncertain_agreement(self, small_logits: torch.Tensor, large_logits: torch.Tensor) -> bool:
        """EASD's extra rejection test on one position's raw logits; never for plain speculative decoding."""
        return False

    def judge(
        self,
        drafts: list[int],
        small_logits: torch.Tensor,
        large_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Verdict:
        """The rejection sampler. ``small_logits``: [gamma, V] raw logits the drafts were drawn from;
        ``large_logits``: [gamma + 1, V] the large model's raw logits at the same positions and one more."""
        greedy = params.temperature == 0.0
        if greedy:
            p = q = None
        else:
            p = sampling_probs(large_logits.float().cpu(), params.temperature, params.top_k, params.top_p)  # [g+1, V]
            q = sampling_probs(small_logits.float().cpu(), params.temperature, params.top_k, params.top_p)  # [g, V]
        for i, token in enumerate(drafts):
            if greedy:
                stands = token == int(torch.argmax(large_logits[i]))
            else:
                assert p is not None and q is not None
                u = float(torch.rand(1, generator=generator))
                stands = u < acceptance_probability(p[i], q[i], token)
            if stands and self.uncertain_agreement(small_logits[i], large_logits[i]):
                if greedy:
                    masked = large_logits[i].clone()
                    masked[token] = -math.inf
                    return Verdict(i, int(torch.argmax(masked)), entropy_rejections=1)
                assert p is not None
                return Verdict(i, _draw(without_token(p[i], token), generator), entropy_rejections=1)
            if not stands:
                if greedy:
                    return Verdict(i, int(torch.argmax(large_logits[i])))
                assert p is not None and q is not None
                return Verdict(i, _draw(residual_probs(p[i], q[i]), generator))
        last = len(drafts)
        if greedy:
            return Verdict(last, int(torch.argmax(large_logits[last])))
        assert p is not None
        return Verdict(last, _draw(p[last], generator))


@dataclass(frozen=True)
class EASD(SpeculativeDecoding):
    """Entropy-aware speculative decoding: speculative decoding that rejects uncertain agreement."""

    name: ClassVar[str] = "easd"

    entropy_threshold: float = 2.0
    """Both models' entropies (bits, raw logits) must exceed this for the rule to fire (inf: never)."""
    top_n: int = 10
    """Size of each model's top-token set compared."""
    overlap_threshold: float = 0.5
    """The sets must share more than this fraction of ``top_n`` tokens, in [0, 1]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("entropy_threshold", self.entropy_threshold, minimum=0.0, allow_inf=True)
        check_int("top_n", self.top_n, minimum=1)
        check_float("overlap_threshold", self.overlap_threshold, minimum=0.0, maximum=1.0)

    def uncertain_agreement(self, small_logits: torch.Tensor, large_logits: torch.Tensor) -> bool:
        if math.isinf(self.entropy_threshold):
            return False
        both = torch.stack([small_logits.float(), large_logits.float()])  # [2, V]
        h_small, h_large = entropy_bits(both).tolist()
        if h_small <= self.entropy_threshold or h_large <= self.entropy_threshold:
            return False
        return top_n_overlap(small_logits, large_logits, self.top_n) > self.overlap_threshold
