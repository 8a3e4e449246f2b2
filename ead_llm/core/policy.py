"""The contract between the engine and the policies: what a policy is, and the decoder each builds per sequence.

A policy is a frozen settings object (what the user configures) with pure transitions over an
explicit per-sequence state: ``start()`` gives the state before the first token
(``start_sequence(key)`` when the state may depend on which sequence it is), ``choose(state)``
names the model that produces the next token, and ``advance(state, role, entropy)`` returns the
state after that model emitted a token whose distribution had ``entropy`` bits (raw logits, before
temperature). Policies never run models and never write to the ledger.

Each policy builds a :class:`Decoder` per sequence (``policy.build_decoder(key, call)``), one class per policy
family (:mod:`ead_llm.policies`). A decoder says what its sequence needs from the next pass
(:meth:`Decoder.read`) and turns the pass's result into actions for the scheduler
(:class:`~ead_llm.core.types.Emit`, ``Draft``, ``Rollback``, ``Fork``). The engine never asks what type a
policy is, and ``ead_llm.core`` never imports ``ead_llm.policies``: families register themselves here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ead_llm.core.types import Action, DraftRound, Emit, Read, Role, RoundVerdict, TokenSample

if TYPE_CHECKING:
    from ead_llm.core.grammar import SequenceGrammar
    from ead_llm.core.request import SamplingParams


class Policy(ABC):
    """Base class of every policy; subclasses are frozen dataclasses."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if isinstance(name, str):
            Policy.registry[name] = cls

    name: ClassVar[str]
    registry: ClassVar[dict[str, type[Policy]]] = {}
    """Every policy class with a ``name``, by name: each registers itself when its module is imported."""
    default_family: ClassVar[Callable[[Policy, Any], Decoder] | None] = None
    """The decoder of a policy that only chooses a model per token (``choose``/``advance``), given the policy
    and its start state; the switching family registers it."""
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

    def withhold(self, state: Any, role: Role, entropy: float) -> Any | None:
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
        decoders of one call (a budget across its prompts). Default: the family that registered itself as
        :attr:`default_family` (switching: one model per token as ``choose`` says)."""
        if Policy.default_family is None:
            raise RuntimeError("no policy family is registered: import ead_llm.policies (or ead_llm) first")
        return Policy.default_family(self, self.start_sequence(key))


class SequenceView(Protocol):
    """What a decoder may read of its sequence (the scheduler's ``Sequence``)."""

    tokens: list[int]
    generated: int
    max_length: int
    """Most positions the sequence may reach (prompt + max_tokens, within the context)."""
    params: SamplingParams
    grammar: SequenceGrammar | None

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
    reads_logits: ClassVar[bool] = True
    """Whether :meth:`on_token` reads a sample's :attr:`~ead_llm.core.types.TokenSample.logits`; where no row of a
    pass has such a decoder, the engine leaves them out (None): a view per row cost 1-2 us a row a step."""

    @abstractmethod
    def read(self, seq: SequenceView) -> Read:
        """What the sequence needs from the next step. Asked again at the next step when the scheduler held its row
        back (:attr:`ead_llm.core.scheduler.Scheduler.hold_large`), so asking must not move the decoder's state."""

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


def check_policy(value: Any, name: str = "policy") -> Policy:
    """Return ``value`` if it is a policy object, else raise a ``ValueError`` that says what to pass."""
    if not isinstance(value, Policy):
        raise ValueError(
            f"{name} must be a policy object such as EAD(threshold=0.25), SmallOnly() or LargeOnly(), got {value!r}"
        )
    return value
