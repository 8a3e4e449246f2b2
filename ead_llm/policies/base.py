"""Decoding policies, and the decoders that carry them out inside the engine.

A policy is a frozen settings object (what the user configures) with pure transitions over an
explicit per-sequence state: ``start()`` gives the state before the first token
(``start_sequence(key)`` when the state may depend on which sequence it is), ``choose(state)``
names the model that produces the next token, and ``advance(state, role, entropy)`` returns the
state after that model emitted a token whose distribution had ``entropy`` bits (raw logits, before
temperature). Policies never run models and never write to the ledger.

Each policy builds a :class:`Decoder` per sequence (``policy.build_decoder(key, call)``), one class per policy
family: switching (:mod:`ead_llm.policies.switching`), draft-and-verify
(:mod:`ead_llm.policies.speculative`), branching (:mod:`ead_llm.policies.eager`). A decoder says what
its sequence needs from the next pass (:meth:`Decoder.read`) and turns the pass's result into
actions for the scheduler (:class:`~ead_llm.core.types.Emit`, ``Draft``, ``Rollback``, ``Fork``);
the engine never asks what type a policy is.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ead_llm.core.types import Action, Emit, Role

if TYPE_CHECKING:
    import torch

    from ead_llm.core.request import SamplingParams


class Policy(ABC):
    """Base class of every policy; subclasses are frozen dataclasses."""

    name: ClassVar[str]
    votes: ClassVar[bool] = False
    """Whether the completion is chosen by a vote over several paths once all have finished (such a
    policy cannot stream)."""

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

    def counters(self) -> tuple[str, ...]:
        """Names of the policy-specific counts its completions report (present, 0 when nothing happened)."""
        return ()

    def select(self, texts: list[str]) -> tuple[int, dict[str, int] | None]:
        """Which path of a request is its completion, given every path's text, and the vote behind the
        choice (None when the policy does not vote). Default: the only path."""
        return 0, None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The sampling settings its sequences run with (a policy may impose some). Default: as asked."""
        return params

    def build_decoder(self, key: int, call: dict[str, Any]) -> Decoder:
        """The decoder of one sequence. ``key``: see :meth:`start_sequence`; ``call``: state shared by the
        decoders of one call (a budget across its prompts). Default: switching, one model per token as
        ``choose`` says."""
        from ead_llm.policies.switching import SwitchingDecoder

        return SwitchingDecoder(self, self.start_sequence(key))


@dataclass(frozen=True)
class Read:
    """What a sequence needs from the next step: logits of ``role`` at its next position, or, with
    ``verify``, at the position before each of its ``drafts`` and one more."""

    role: Role
    verify: bool = False
    drafts: int = 0

    @property
    def positions(self) -> int:
        """Positions whose logits the pass returns for this sequence."""
        return self.drafts + 1 if self.verify else 1


@dataclass(frozen=True)
class TokenSample:
    """One sequence's row of a pass, sampled."""

    role: Role
    token: int
    """Drawn under the sequence's sampling settings (argmax when greedy)."""
    entropy: float
    """Bits, of the raw logits."""
    logits: torch.Tensor
    """[V] raw logits (a view into the pass's output; a draft keeps it for its verification)."""
    top2: tuple[int, int] | None = None
    """The two most likely tokens, when the decoder asked for branch statistics."""
    top_k_nats: float | None = None
    """EAGER's entropy (nats over the renormalised top-k), when asked for."""


@dataclass(frozen=True)
class RoundVerdict:
    """A speculative round, judged (see :mod:`ead_llm.core.rejection_sampler`)."""

    accepted: int
    token: int | None
    """The large model's token that closes the round; None: the round ends with its drafts."""
    entropy_rejection: bool
    target_entropy: tuple[float, ...]
    """Bits of the large model's logits at each verified position."""


@dataclass(frozen=True)
class DraftRound:
    """What the rejection sampler needs of one sequence's round."""

    tokens: tuple[int, ...]
    logits: tuple[torch.Tensor, ...]
    """[V] raw logits each draft was drawn from."""
    entropies: tuple[float, ...]
    first_position: int
    """Position of the first draft in the sequence."""
    entropy_threshold: float = math.inf
    top_n: int = 1
    overlap_threshold: float = 1.0
    oracle: bool = False


class SequenceView(Protocol):
    """What a decoder may read of its sequence (the scheduler's ``Sequence``)."""

    tokens: list[int]
    generated: int
    max_length: int
    """Most positions the sequence may reach (prompt + max_tokens, within the context)."""

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends the text (EOS, unless the request ignores it)."""


class ForkRoom(Protocol):
    """The scheduler's answer to "may this sequence branch now?"; ``take`` claims a place."""

    def take(self) -> bool: ...


class Decoder(ABC):
    """Drives one sequence under its policy: what it needs from each step, and what the result means."""

    branch_stats: ClassVar[bool] = False
    """Whether its sampled rows need the top-2 tokens and EAGER's entropy."""
    branch_top_k: int = 20
    """The probabilities EAGER's entropy is measured over, when ``branch_stats``."""
    forks: ClassVar[bool] = False
    """Whether it may branch new paths (its text is then made on the scheduler thread)."""

    @abstractmethod
    def read(self, seq: SequenceView) -> Read:
        """What the sequence needs from the next step."""

    def on_token(self, seq: SequenceView, sample: TokenSample, room: ForkRoom) -> list[Action]:
        """The actions for a sampled row of this sequence."""
        raise NotImplementedError(f"{type(self).__name__} does not sample")

    def draft_round(self, seq: SequenceView) -> DraftRound:
        """The round to verify, for a ``Read(verify=True)``."""
        raise NotImplementedError(f"{type(self).__name__} does not verify drafts")

    def on_verdict(self, seq: SequenceView, verdict: RoundVerdict) -> list[Action]:
        """The actions for a judged round."""
        raise NotImplementedError(f"{type(self).__name__} does not verify drafts")

    def on_preempt(self, seq: SequenceView) -> int:
        """The sequence loses its caches (the scheduler needs the memory): how many of its tokens
        stand (drafts are dropped). Default: all of them."""
        return len(seq.tokens)

    def fork(self) -> Decoder:
        """The decoder of a path branched off this one."""
        raise NotImplementedError(f"{type(self).__name__} does not branch")

    @staticmethod
    def emit(sample: TokenSample, counters: tuple[tuple[str, int], ...] = ()) -> Emit:
        return Emit(sample.token, sample.role, sample.entropy, counters)


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
    import ead_llm.policies.controls
    import ead_llm.policies.eager
    import ead_llm.policies.speculative
    import ead_llm.policies.switching  # noqa: F401 (every family registers its policies as subclasses)

    found: dict[str, type[Policy]] = {}
    pending = list(Policy.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        name = getattr(cls, "name", None)
        if isinstance(name, str):
            found[name] = cls
    return found


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
