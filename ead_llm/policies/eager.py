"""EAGER (arXiv 2510.11170): spend extra reasoning paths only where the model is unsure.

All paths of a prompt decode together, batched with everything else. After each token the
branching decoder asks :meth:`EAGER.should_branch`: a path branches when the token's entropy
exceeds ``max(theta, running percentile of this prompt's entropies)`` and the prompt may still add a
path; the original continues with the top-1 token and the new path, which shares the prefix's KV
blocks (copied only where written), with the top-2 token. Branching stops at the prompt's path cap
or after ``patience`` tokens without a branch. When every path has finished, :meth:`EAGER.vote`
takes the majority of the extracted answers; the completion is the first path that gave the
winning answer, with the prefix it shares with its parents.

Budget: a call's prompts share ``max_paths x prompts`` paths, and the call never holds more. A
prompt below ``max_paths`` branches while the call is under budget; one at ``max_paths`` or more
borrows what the others have not used, up to ``budget_limit x max_paths`` paths. Borrowed paths are
not returned: a lender that needs its share later finds the call at its budget.

Entropy here is EAGER's own measure: nats over the renormalised top-``top_k`` probabilities of
the producing model's raw logits (the reference code's choice), not the bits EAD uses. Which model
produces each token is the ``decoder`` policy's choice: ``LargeOnly()`` (the default),
``SmallOnly()``, or an ``EAD(...)`` switching over the pair (each path keeps its own EAD state).

The vote's answers come from ``extractor``: a function of the text, or the name of one in
:data:`ead_llm.evaluation.extract.EXTRACTORS`; the default ``auto`` reads ``#### N``, ``\\boxed{}``
or the last number, else the last line, so that plain text votes too.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ead_llm.core.request import MAX_TEMPERATURE, SamplingParams
from ead_llm.core.types import Action, Emit, Fork, Role
from ead_llm.core.validation import check_float, check_int
from ead_llm.evaluation.extract import EXTRACTORS
from ead_llm.policies.base import (
    Decoder,
    ForkRoom,
    LargeOnly,
    Policy,
    Read,
    SequenceView,
    TokenSample,
    check_policy,
    describe_policy,
)
from ead_llm.policies.switching import SwitchingDecoder

Extractor = Callable[[str], Hashable | None]


@dataclass(frozen=True)
class EAGER(Policy):
    """Entropy-guided branching with a per-call budget and a majority vote over the paths."""

    name: ClassVar[str] = "eager"
    votes: ClassVar[bool] = True

    theta: float = 2.0
    """Entropy floor for branching, nats over the top-``top_k`` probabilities (inf: never branch)."""
    max_paths: int = 8
    """Paths per prompt before borrowing from the call's budget (>= 1)."""
    percentile: float = 99.0
    """A branch needs the entropy above this percentile (0-100) of the prompt's entropies so far."""
    temperature: float = 0.6
    """Sampling temperature of every path (0: greedy paths)."""
    decoder: Policy = field(default_factory=LargeOnly)
    """Which model writes each token: LargeOnly(), SmallOnly() or EAD(...)."""
    patience: int = 1000
    """Tokens of a prompt without a branch after which it branches no more."""
    budget_limit: int = 3
    """Most paths one prompt may reach, in units of ``max_paths``."""
    top_k: int = 20
    """Probabilities the entropy is measured over."""
    extractor: Extractor | str = "auto"
    """Final answer of a path's text for the vote (None: no answer): a function, or an extractor's name
    (``auto``, ``hashes``, ``last_number``, ``boxed``, ``first_line``, ``choice``, ``exact``)."""

    def __post_init__(self) -> None:
        check_float("theta", self.theta, minimum=0.0, allow_inf=True)
        check_int("max_paths", self.max_paths, minimum=1)
        check_float("percentile", self.percentile, minimum=0.0, maximum=100.0)
        check_float("temperature", self.temperature, minimum=0.0, maximum=MAX_TEMPERATURE)
        check_policy(self.decoder, "decoder")
        if not isinstance(self.decoder.build_decoder(0, {}), SwitchingDecoder):
            raise ValueError(
                "decoder must be a switching policy such as LargeOnly(), SmallOnly() or EAD(...), "
                f"not {type(self.decoder).__name__} (draft-and-verify or branching policies cannot be nested)"
            )
        check_int("patience", self.patience, minimum=0)
        check_int("budget_limit", self.budget_limit, minimum=1)
        check_int("top_k", self.top_k, minimum=2)
        if isinstance(self.extractor, str):
            if self.extractor not in EXTRACTORS:
                raise ValueError(f"extractor must be a function or one of {sorted(EXTRACTORS)}, got {self.extractor!r}")
        elif not callable(self.extractor):
            raise ValueError(f"extractor must be a function of the text or an extractor's name, got {self.extractor!r}")

    # each path decodes under the decoder's rules
    def start(self) -> Any:
        return self.decoder.start()

    def start_sequence(self, key: int) -> Any:
        return self.decoder.start_sequence(key)

    def choose(self, state: Any) -> Role:
        return self.decoder.choose(state)

    def advance(self, state: Any, role: Role, entropy: float) -> Any:
        return self.decoder.advance(state, role, entropy)

    def withhold(self, state: Any, role: Role, entropy: float) -> Any | None:
        return self.decoder.withhold(state, role, entropy)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "theta": self.theta,
            "max_paths": self.max_paths,
            "percentile": self.percentile,
            "temperature": self.temperature,
            "decoder": describe_policy(self.decoder),
            "patience": self.patience,
            "budget_limit": self.budget_limit,
            "top_k": self.top_k,
            "extractor": self.extractor
            if isinstance(self.extractor, str)
            else getattr(self.extractor, "__qualname__", repr(self.extractor)),
        }

    def counters(self) -> tuple[str, ...]:
        return ("paths", "branches", *self.decoder.counters())

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """Every path samples at EAGER's own temperature."""
        return replace(params, temperature=self.temperature)

    def build_decoder(self, key: int, call: dict[str, Any]) -> BranchingDecoder:
        budget = call.setdefault("eager_budget", CallBudget())
        budget.prompts += 1
        budget.paths += 1
        inner = self.decoder.build_decoder(key, call)
        assert isinstance(inner, SwitchingDecoder)
        return BranchingDecoder(self, inner, PromptPaths(budget))

    def path_cap(self, prompt_paths: int, call_paths: int, prompts: int) -> bool:
        """May a prompt with ``prompt_paths`` paths add one, when the call has ``call_paths`` over ``prompts``?"""
        # the call never holds more than its budget, borrowed paths included
        return call_paths < self.max_paths * prompts and prompt_paths < self.budget_limit * self.max_paths

    def should_branch(
        self,
        entropy: float,
        earlier: RunningPercentile,
        since_branch: int,
        prompt_paths: int,
        call_paths: int,
        prompts: int,
    ) -> bool:
        """Branch at this token? (``earlier``: the prompt's entropies before it.)"""
        if math.isinf(self.theta) or since_branch > self.patience:
            return False
        threshold = max(self.theta, earlier.value(self.percentile))
        return entropy > threshold and self.path_cap(prompt_paths, call_paths, prompts)

    def select(self, texts: list[str]) -> tuple[int, dict[str, int] | None]:
        return self.vote(texts)

    def vote(self, texts: list[str]) -> tuple[int, dict[str, int]]:
        """Index of the chosen path and the vote counts (answers as strings).

        The answer given by most paths wins; a tie goes to the answer whose first path came first;
        paths without an answer do not vote, and if none has one the first path is chosen.
        """
        extract = EXTRACTORS[self.extractor] if isinstance(self.extractor, str) else self.extractor
        answers = [extract(text) for text in texts]
        counts = Counter(a for a in answers if a is not None)
        if not counts:
            return 0, {}
        best = max(counts.values())
        winner = next(a for a in answers if a is not None and counts[a] == best)
        return answers.index(winner), {str(a): n for a, n in counts.items()}


class RunningPercentile:
    """A percentile of a growing list of numbers, kept sorted as they arrive (no re-sort per query).

    Linear interpolation between closest ranks, as ``torch.quantile``; -inf while empty.
    """

    def __init__(self) -> None:
        self._sorted: list[float] = []

    def add(self, value: float) -> None:
        bisect.insort(self._sorted, value)

    def __len__(self) -> int:
        return len(self._sorted)

    def value(self, q: float) -> float:
        """The ``q``-th percentile (0-100)."""
        values = self._sorted
        if not values:
            return -math.inf
        rank = q / 100.0 * (len(values) - 1)
        low = math.floor(rank)
        high = min(low + 1, len(values) - 1)
        weight = rank - low
        a, b = values[low], values[high]
        return a + weight * (b - a) if weight < 0.5 else b - (b - a) * (1.0 - weight)  # torch.lerp's rounding


@dataclass
class CallBudget:
    """A call's EAGER prompts and the paths they hold together (shared by the call's decoders)."""

    prompts: int = 0
    paths: int = 0


@dataclass
class PromptPaths:
    """What the branching rule knows of one prompt's paths (shared by those paths' decoders)."""

    budget: CallBudget
    paths: int = 1
    branches: int = 0
    entropies: RunningPercentile = field(default_factory=RunningPercentile)
    since_branch: int = 0


class BranchingDecoder(Decoder):
    """The branching family: a switching decoder per path, plus EAGER's rule to branch a new path."""

    branch_stats: ClassVar[bool] = True
    forks: ClassVar[bool] = True
    reads_logits: ClassVar[bool] = False  # (nor does its inner switching decoder)

    def __init__(self, policy: EAGER, inner: SwitchingDecoder, prompt: PromptPaths, *, root: bool = True) -> None:
        self.policy, self.inner, self.prompt, self.root = policy, inner, prompt, root
        self.branch_top_k = policy.top_k

    def read(self, seq: SequenceView) -> Read:
        return self.inner.read(seq)

    def on_token(self, seq: SequenceView, sample: TokenSample, room: ForkRoom) -> list[Action]:
        actions = self.inner.on_token(seq, sample, room)
        if not actions:  # the inner policy withheld the token (EAD's lookahead)
            return actions
        (emit,) = actions
        assert isinstance(emit, Emit)
        prompt, policy = self.prompt, self.policy
        assert sample.top_k_nats is not None and sample.top2 is not None
        prompt.since_branch += 1
        branch = policy.should_branch(
            sample.top_k_nats,
            prompt.entropies,
            prompt.since_branch,
            prompt.paths,
            prompt.budget.paths,
            prompt.budget.prompts,
        )
        prompt.entropies.add(sample.top_k_nats)
        fork: list[Action] = []
        if branch and room.take():
            first, second = sample.top2
            emit = replace(emit, token=first)
            prompt.paths += 1
            prompt.branches += 1
            prompt.budget.paths += 1
            prompt.since_branch = 0
            fork = [Fork(second, sample.role, sample.entropy, (("paths", 1), ("branches", 1)))]
        if seq.generated == 0 and self.root:
            emit = replace(emit, counters=(*emit.counters, ("paths", 1)))
        return [*fork, emit]

    def fork(self) -> BranchingDecoder:
        return BranchingDecoder(self.policy, self.inner.copy(), self.prompt, root=False)
