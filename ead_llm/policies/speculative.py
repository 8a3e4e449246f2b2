"""Draft-and-verify policies: lossless speculative decoding, and EASD's entropy-aware rejection.

A round: the small model drafts up to ``gamma`` tokens (one engine step each, batched with other
sequences' drafts), then the large model scores the last accepted token and every draft in one
pass. The rejection sampler (:mod:`ead_llm.core.rejection_sampler`, every round of a step in one
batch) decides how many drafts stand and draws the round's last token: the correction after a
rejection, or a bonus token from the large model when every draft stood. Rejected positions are
rolled back by moving each model's cache length back (nothing is recomputed). The engine emits the
accepted drafts (attributed to the small model) and the round's last token (the large model) as
ordinary token events.

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
from typing import TYPE_CHECKING, Any, ClassVar

from ead_llm.core.policy import Decoder, ForkRoom, Policy, SequenceView
from ead_llm.core.types import Action, Draft, DraftRound, Emit, Read, Role, Rollback, RoundVerdict, TokenSample
from ead_llm.core.validation import check_float, check_int

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SpecState:
    """Where a sequence is in its round."""

    gamma: int
    """Drafts this round (after the engine's length budget)."""
    drafted: int = 0
    """Drafts made so far this round."""
    next_gamma: int = 0
    """Drafts the next round asks for (adaptive gamma moves it)."""
    stood: float = 0.0
    """Adaptive gamma: drafts that stood in earlier rounds, each round's count decayed by :data:`DECAY` per round."""
    judged: float = 0.0
    """Adaptive gamma: drafts judged in earlier rounds (those that stood and the one rejected), decayed alike."""


DECAY = 0.8
"""Weight a round's acceptance count keeps per later round (about the last five rounds count)."""
PRIOR = (1.0, 2.0)
"""Drafts standing of drafts judged assumed before any round (an acceptance rate of one half, worth two drafts)."""


def acceptance_rate(stood: float, judged: float) -> float:
    """The chance a draft stands given the one before it did, estimated from decayed counts with :data:`PRIOR`."""
    return (stood + PRIOR[0]) / (judged + PRIOR[1])


def best_gamma(rate: float, draft_cost: float, max_gamma: int) -> int:
    """The number of drafts that maximises tokens per unit of cost when each draft stands with probability ``rate``
    given the one before it did: a round of ``g`` drafts yields ``1 + rate + ... + rate**g`` tokens (those that
    stand and the large model's own) for ``1 + g * draft_cost`` (one verification plus the drafts)."""
    best, best_value, tokens, power = 1, 0.0, 1.0, 1.0
    for g in range(1, max_gamma + 1):
        power *= rate
        tokens += power
        value = tokens / (1.0 + g * draft_cost)
        if value > best_value:
            best, best_value = g, value
    return best


@dataclass(frozen=True)
class SpeculativeDecoding(Policy):
    """Lossless speculative decoding: the small model drafts ``gamma`` tokens, the large one verifies."""

    name: ClassVar[str] = "speculative"

    gamma: int = 4
    """Drafts per round (>= 1)."""
    adaptive_gamma: bool = False
    """Choose each round's drafts from the sequence's recent acceptance: the rate at which drafts stood over the
    last rounds (decayed) gives the draft count that yields the most tokens per unit of cost (:func:`best_gamma`);
    ``gamma`` is the first round's."""
    max_gamma: int = 16
    """Upper bound of adaptive gamma."""
    draft_cost: float = 0.1
    """Adaptive gamma: what a draft costs as a share of a verification (the small model's token against the large
    model's pass; a feature draft on SmolLM2 costs 0.06 of its target, a pass that verifies a few more tokens a
    little more than one that reads one)."""
    stop_entropy: float = math.inf
    """End a round early after a draft drawn from a distribution of more than this entropy (bits, the small model's
    raw logits): a draft the small model is unsure of is the likeliest to be rejected, and the drafts after it fall
    with it (inf: never; the output is lossless either way)."""
    siblings: bool = False
    """Greedy rows without a grammar: verify the small model's second choice at every drafted position beside its
    first, in the same pass (a tree of the chain and one leaf per position, each leaf attending to the tokens before
    its position). When a draft falls and the large model's own token there is that second choice, the large model's
    token after it was read at the leaf, so the round emits one more token: a round that would close with a
    correction closes with two. Lossless (every token is still the large model's argmax); the verify pass reads
    ``2 * gamma + 1`` positions instead of ``gamma + 1``."""

    def __post_init__(self) -> None:
        check_int("gamma", self.gamma, minimum=1)
        check_int("max_gamma", self.max_gamma, minimum=self.gamma)
        check_float("draft_cost", self.draft_cost, minimum=0.0)
        check_float("stop_entropy", self.stop_entropy, minimum=0.0, allow_inf=True)
        if not isinstance(self.adaptive_gamma, bool):
            raise ValueError(f"adaptive_gamma must be a bool, got {self.adaptive_gamma!r}")
        if not isinstance(self.siblings, bool):
            raise ValueError(f"siblings must be a bool, got {self.siblings!r}")

    def start(self) -> SpecState:
        return SpecState(gamma=self.gamma, next_gamma=self.gamma)

    def choose(self, state: SpecState) -> Role:
        return Role.SMALL if state.drafted < state.gamma else Role.LARGE

    def advance(self, state: SpecState, role: Role, entropy: float) -> SpecState:
        """One draft made; the round ends with it if it was drawn with more than ``stop_entropy`` bits."""
        state = replace(state, drafted=state.drafted + 1)
        return self.cut_round(state) if entropy > self.stop_entropy else state

    def begin_round(self, state: SpecState, budget: int) -> SpecState:
        """Start a round drafting at most ``budget`` tokens (what the length limits leave)."""
        return replace(state, gamma=max(0, min(state.next_gamma, budget)), drafted=0)

    def drafts_ahead(self, state: SpecState) -> int:
        """Drafts left in this round that nothing but an end of text can cut short: all of them, or one where a
        draft's entropy may end the round (``stop_entropy``)."""
        left = max(0, state.gamma - state.drafted)
        return left if math.isinf(self.stop_entropy) else min(left, 1)

    def cut_round(self, state: SpecState) -> SpecState:
        """Stop drafting now (the last draft ends the text: nothing after it could be kept)."""
        return replace(state, gamma=state.drafted)

    def end_round(self, state: SpecState, drafted: int, accepted: int) -> SpecState:
        """Adaptive gamma: count the round's drafts that stood and were judged, and size the next round."""
        if not self.adaptive_gamma or not drafted:
            return replace(state, gamma=state.next_gamma, drafted=0)
        stood = DECAY * state.stood + accepted
        judged = DECAY * state.judged + accepted + (accepted < drafted)
        gamma = best_gamma(acceptance_rate(stood, judged), self.draft_cost, self.max_gamma)
        return SpecState(gamma=gamma, drafted=0, next_gamma=gamma, stood=stood, judged=judged)

    def counters(self) -> tuple[str, ...]:
        siblings = ("sibling_tokens",) if self.siblings else ()
        return ("drafted_tokens", "accepted_tokens", "entropy_rejections", *siblings)

    def rejection_settings(self) -> dict[str, Any]:
        """How the rejection sampler judges this policy's drafts (beyond speculative sampling's rule)."""
        return {}

    def build_decoder(self, key: int, call: dict[str, Any]) -> DraftVerifyDecoder:
        return DraftVerifyDecoder(self, self.start_sequence(key))


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

    def rejection_settings(self) -> dict[str, Any]:
        return {
            "entropy_threshold": self.entropy_threshold,
            "top_n": self.top_n,
            "overlap_threshold": self.overlap_threshold,
        }


class DraftVerifyDecoder(Decoder):
    """The draft-and-verify family: the small model drafts a round one step at a time (batched with
    other sequences' steps), then the large model reads the round in one pass and the rejection
    sampler (:mod:`ead_llm.core.rejection_sampler`) judges it with every other round of the step.

    After the verdict the caches are rolled back by length: the small model keeps what stood, and
    the large model, when no token of its own closes the round, re-reads the last kept draft next
    round (its logits there are what the next round's first draft is judged against). The round's
    passes are billed with its first emitted token.
    """

    def __init__(self, policy: SpeculativeDecoding, state: SpecState) -> None:
        self.policy, self.state = policy, state
        self.drafts: list[tuple[int, torch.Tensor, float]] = []
        """This round's drafts: token, the small model's raw logits it was drawn from, their entropy."""
        self.seconds: list[int] = []
        """With siblings: the small model's second choice at each draft's position."""
        self.branch_stats = policy.siblings  # type: ignore[misc]  # the top two of each draft, for its sibling

    def read(self, seq: SequenceView) -> Read:
        if not self.drafts:
            room = max(0, seq.max_length - len(seq.tokens) - 1)  # drafts that leave room for the closing token
            self.state = self.policy.begin_round(self.state, room)
        if self.policy.choose(self.state) is Role.SMALL:
            chained = _greedy_unconstrained(seq) and not self.branch_stats
            return Read(Role.SMALL, chain=self.policy.drafts_ahead(self.state) if chained else 0)
        return Read(Role.LARGE, verify=True, drafts=len(self.drafts), siblings=self._siblings(seq))

    def _siblings(self, seq: SequenceView) -> tuple[int, ...]:
        """The second choices to verify beside the drafts (one per draft made, an end-of-text draft's included):
        greedy rows without a grammar only (the check is the large model's argmax)."""
        if not self.seconds or not _greedy_unconstrained(seq):
            return ()
        return tuple(self.seconds[: len(self.drafts)])

    def on_token(self, seq: SequenceView, sample: TokenSample, room: ForkRoom) -> list[Action]:
        self.state = self.policy.advance(self.state, sample.role, sample.entropy)
        assert sample.logits is not None  # (it reads them: Decoder.reads_logits)
        self.drafts.append((sample.token, sample.logits, sample.entropy))
        if sample.top2 is not None:
            first, second = sample.top2
            self.seconds.append(second if first == sample.token else first)
        if seq.is_end(sample.token):  # nothing after an end-of-text draft could be kept
            self.state = self.policy.cut_round(self.state)
        return [Draft(sample.token)]

    def draft_round(self, seq: SequenceView) -> DraftRound:
        tokens, logits, entropies = zip(*self.drafts, strict=True) if self.drafts else ((), (), ())
        return DraftRound(
            tokens=tuple(tokens),
            logits=tuple(logits),
            entropies=tuple(entropies),
            first_position=len(seq.tokens) - len(self.drafts),
            siblings=self._siblings(seq),
            **self.policy.rejection_settings(),
        )

    def on_verdict(self, seq: SequenceView, verdict: RoundVerdict) -> list[Action]:
        drafted, accepted = len(self.drafts), verdict.accepted
        prefix = len(seq.tokens) - drafted
        large_seen = prefix + accepted - (1 if verdict.token is None else 0)
        moves: tuple[tuple[Role, int, int], ...] = ()
        if verdict.extra is not None:  # the sibling read after the row's end is the closing token: its keys stand
            moves, large_seen = ((Role.LARGE, len(seq.tokens) + accepted, large_seen),), large_seen + 1
        rollback = Rollback(prefix, ((Role.LARGE, large_seen), (Role.SMALL, prefix + accepted)), moves)
        self.state = self.policy.end_round(self.state, drafted, accepted)
        emitted = [Emit(token, Role.SMALL, entropy) for token, _, entropy in self.drafts[:accepted]]
        if verdict.token is not None:
            emitted.append(Emit(verdict.token, Role.LARGE, verdict.target_entropy[accepted]))
        if verdict.extra is not None:  # read at the sibling that matched the closing token
            emitted.append(Emit(verdict.extra, Role.LARGE, verdict.extra_entropy))
        self.drafts, self.seconds = [], []
        counters = (
            ("drafted_tokens", drafted),
            ("accepted_tokens", accepted),
            ("entropy_rejections", int(verdict.entropy_rejection)),
            *((("sibling_tokens", int(verdict.extra is not None)),) if self.policy.siblings else ()),
        )
        if emitted:
            emitted[0] = replace(emitted[0], counters=counters)
        return [rollback, *emitted]

    def on_preempt(self, seq: SequenceView) -> int:
        keep = len(seq.tokens) - len(self.drafts)
        self.drafts, self.seconds = [], []  # the round starts again once the sequence is back
        return keep


def _greedy_unconstrained(seq: SequenceView) -> bool:
    """A greedy row without a grammar: its drafts and checks are argmaxes alone (what chains and siblings need)."""
    return seq.params.temperature == 0 and seq.grammar is None
