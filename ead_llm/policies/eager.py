"""EAGER (arXiv 2510.11170): spend extra reasoning paths only where the model is unsure.

All paths of a prompt decode together, batched with everything else. After each token the engine
asks :meth:`EAGER.should_branch`: a path branches when the token's entropy exceeds
``max(theta, running percentile of this prompt's entropies)`` and the prompt may still add a path;
the original continues with the top-1 token and the new path, which starts from a copy of the
prefix's KV cache, with the top-2 token. Branching stops at the prompt's path cap or after
``patience`` tokens without a branch. When every path has finished, :meth:`EAGER.vote` takes the
majority of the extracted answers; the completion is the first path that gave the winning answer.

Budget: a call's prompts share ``max_paths x prompts`` paths. A prompt may go past ``max_paths``
while the call's total is under that budget (paths easy prompts left unused), up to
``budget_limit x max_paths`` paths for one prompt.

Entropy here is EAGER's own measure: nats over the renormalised top-``top_k`` probabilities of
the producing model's raw logits (the reference code's choice), not the bits EAD uses. Which model
produces each token is the ``decoder`` policy's choice: ``LargeOnly()`` (the default),
``SmallOnly()``, or an ``EAD(...)`` switching over the pair (each path keeps its own EAD state).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ead_llm.core.ops import percentile
from ead_llm.core.types import Role
from ead_llm.core.validation import check_float, check_int
from ead_llm.evaluation.task import extract_answer
from ead_llm.policies.base import LargeOnly, Policy, check_policy, describe_policy

Extractor = Callable[[str], Hashable | None]


@dataclass(frozen=True)
class EAGER(Policy):
    """Entropy-guided branching with a per-call budget and a majority vote over the paths."""

    name: ClassVar[str] = "eager"

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
    extractor: Extractor = extract_answer
    """Final answer of a path's text for the vote (None: no answer); the embedded task's by default."""

    def __post_init__(self) -> None:
        check_float("theta", self.theta, minimum=0.0, allow_inf=True)
        check_int("max_paths", self.max_paths, minimum=1)
        check_float("percentile", self.percentile, minimum=0.0, maximum=100.0)
        check_float("temperature", self.temperature, minimum=0.0)
        check_policy(self.decoder, "decoder")
        if isinstance(self.decoder, EAGER) or not hasattr(self.decoder, "advance"):
            raise ValueError("decoder must be LargeOnly(), SmallOnly() or EAD(...)")
        from ead_llm.policies.speculative import SpeculativeDecoding

        if isinstance(self.decoder, SpeculativeDecoding):
            raise ValueError("decoder must be LargeOnly(), SmallOnly() or EAD(...), not a draft-and-verify policy")
        check_int("patience", self.patience, minimum=0)
        check_int("budget_limit", self.budget_limit, minimum=1)
        check_int("top_k", self.top_k, minimum=2)
        if not callable(self.extractor):
            raise ValueError(f"extractor must be a function of the text, got {self.extractor!r}")

    # each path decodes under the decoder's rules
    def start(self) -> Any:
        return self.decoder.start()

    def start_sequence(self, key: int) -> Any:
        return self.decoder.start_sequence(key)

    def choose(self, state: Any) -> Role:
        return self.decoder.choose(state)

    def advance(self, state: Any, role: Role, entropy: float) -> Any:
        return self.decoder.advance(state, role, entropy)

    def preempt(self, state: Any, role: Role, entropy: float) -> Any | None:
        return self.decoder.preempt(state, role, entropy)

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
            "extractor": getattr(self.extractor, "__qualname__", repr(self.extractor)),
        }

    def threshold(self, entropies: list[float]) -> float:
        """The entropy a token must exceed to branch, given the prompt's entropies so far."""
        return max(self.theta, percentile(entropies, self.percentile))

    def path_cap(self, prompt_paths: int, call_paths: int, prompts: int) -> bool:
        """May a prompt with ``prompt_paths`` paths add one, when the call has ``call_paths`` over ``prompts``?"""
        if prompt_paths < self.max_paths:
            return True
        return call_paths < self.max_paths * prompts and prompt_paths < self.budget_limit * self.max_paths

    def should_branch(
        self, entropy: float, earlier: list[float], since_branch: int, prompt_paths: int, call_paths: int, prompts: int
    ) -> bool:
        """Branch at this token? (``earlier``: the prompt's entropies before it.)"""
        if math.isinf(self.theta) or since_branch > self.patience:
            return False
        return entropy > self.threshold(earlier) and self.path_cap(prompt_paths, call_paths, prompts)

    def vote(self, texts: list[str]) -> tuple[int, dict[str, int]]:
        """Index of the chosen path and the vote counts (answers as strings).

        The answer given by most paths wins; a tie goes to the answer whose first path came first;
        paths without an answer do not vote, and if none has one the first path is chosen.
        """
        answers = [self.extractor(text) for text in texts]
        counts = Counter(a for a in answers if a is not None)
        if not counts:
            return 0, {}
        best = max(counts.values())
        winner = next(a for a in answers if a is not None and counts[a] == best)
        return answers.index(winner), {str(a): n for a, n in counts.items()}
