"""Small value types that pass between the roles: the scheduler, the decoders, the runner, the ledger."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Give a frozen dataclass an ``__init__`` that fills the instance's ``__dict__`` directly, with the same signature
    and defaults. The generated one sets each field through ``object.__setattr__``: 1.2-2.3 us for the types the
    engine makes several of per row per step (a read, a pass row, its work, a sample, an emitted token, EAD's state)
    against 0.6-1.0 this way, called positionally. The class stays frozen, equal and hashable as before. For frozen
    dataclasses whose fields are all plain ``__init__`` parameters (no ``__post_init__``, default factory,
    keyword-only field, slots, nor a field named ``self`` or ``own``): others are refused."""
    settings = getattr(cls, "__dataclass_params__", None)
    if settings is None or not settings.frozen or "__slots__" in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init takes a frozen dataclass without slots or __post_init__, not {cls.__name__}")
    arguments, body, defaults = [], [], {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING or f.name in ("self", "own"):
            raise TypeError(f"quick_init: {cls.__name__}.{f.name} is not a plain __init__ parameter")
        if f.default is dataclasses.MISSING:
            arguments.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            arguments.append(f"{f.name}=_default_{f.name}")
        body.append(f"    own[{f.name!r}] = {f.name}\n")
    namespace = dict(defaults)
    exec(f"def __init__(self, {', '.join(arguments)}):\n    own = self.__dict__\n{''.join(body)}", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


class Role(str, Enum):
    """Which model of the pair."""

    SMALL = "small"
    LARGE = "large"

    @property
    def letter(self) -> str:
        """``S`` or ``L``: how the adapters mark which model wrote a token."""
        return "S" if self is Role.SMALL else "L"


class FinishReason(str, Enum):
    """Why a sequence ended (OpenAI's vocabulary: a stop string or EOS is ``stop``)."""

    STOP = "stop"
    LENGTH = "length"


@quick_init
@dataclass(frozen=True)
class ForwardWork:
    """One forward pass of one model over one sequence: ``tokens`` new positions after ``past``, of which the
    first ``recomputed`` are positions the model had processed before the engine evicted the sequence's cache
    to make room for others (work that depends on the load, billed apart)."""

    role: Role
    tokens: int
    past: int
    recomputed: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token of one sequence; the engine yields exactly one per generated token.

    ``text`` is the text released by this token: it may be empty while the detokenizer waits
    for the rest of a UTF-8 character or the stop matcher holds back a possible stop string, and
    the last event of a sequence carries everything still held. Joining the ``text`` of a
    sequence's events gives its completion. ``work`` lists the forward passes run to produce
    this token (prompt prefill and catch-up included; for speculative decoding, the first token of
    a round carries the round's drafts and verification). ``counters`` are policy-specific counts
    the ledger sums (``drafted_tokens``, ``accepted_tokens``, ``entropy_rejections``).
    """

    index: int
    token_id: int
    text: str
    role: Role
    entropy: float
    work: tuple[ForwardWork, ...]
    finish_reason: FinishReason | None = None
    counters: tuple[tuple[str, int], ...] = ()
    path: int = 0
    """Which path of its request wrote the token (EAGER branches; always 0 otherwise)."""
    prompt_tokens: int = 0
    """On a request's first event (path 0): the prompt tokens it decoded from, after any truncation;
    0 on every other event, so that summing over events counts each prompt once."""
    cached_tokens: tuple[tuple[Role, int], ...] = ()
    """On a request's first event (path 0): ``(role, positions)`` for each model that took prompt positions from
    its prefix cache instead of computing them (they are not in ``work``)."""
    branched_from: tuple[int, int] | None = None
    """On the first event of a path branched off another (EAGER): ``(parent path, tokens)``, the path
    continues the first ``tokens`` generated tokens of its parent."""
    hidden_states: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """On a sequence's last event, from an engine built with ``return_hidden_states=True``: the large model's final
    hidden state (after its last norm, what its head reads) at every position fed to it, prompt and answer but the
    last token, ``[prompt + generated - 1, hidden]`` in the model's dtype; NaN at positions it never read (EAD's
    tokens written by the small model and not yet caught up)."""


def token_event(
    index: int,
    token_id: int,
    text: str,
    role: Role,
    entropy: float,
    work: tuple[ForwardWork, ...],
    finish_reason: FinishReason | None,
    counters: tuple[tuple[str, int], ...],
    path: int,
    prompt_tokens: int,
    cached_tokens: tuple[tuple[Role, int], ...],
    branched_from: tuple[int, int] | None,
    hidden_states: torch.Tensor | None = None,
) -> TokenEvent:
    """A :class:`TokenEvent` made without the frozen dataclass's ``__init__``, which sets each field through
    ``object.__setattr__`` (2.5 us against 0.5 us here): the scheduler makes one per generated token. Every field
    is given; a test keeps this list equal to the class's."""
    event = object.__new__(TokenEvent)  # the hot path's events, made as with_text makes its copies
    event.__dict__.update(
        index=index,
        token_id=token_id,
        text=text,
        role=role,
        entropy=entropy,
        work=work,
        finish_reason=finish_reason,
        counters=counters,
        path=path,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        branched_from=branched_from,
        hidden_states=hidden_states,
    )
    return event


def with_text(event: TokenEvent, text: str) -> TokenEvent:
    """``event`` with its text filled in (``dataclasses.replace`` without its per-field overhead)."""
    filled = object.__new__(TokenEvent)
    filled.__dict__.update(event.__dict__, text=text)
    return filled


@dataclass(frozen=True)
class RowFailure:
    """Request ``index`` of a call failed with ``error`` (its other requests carry on)."""

    index: int
    error: BaseException


# -- what a decoder asks the scheduler to do with a sequence (core/policy.py's Decoder returns them)


@quick_init
@dataclass(frozen=True)
class Emit:
    """Append ``token`` to the output, written by ``role`` from a distribution of ``entropy`` bits; it
    carries the work not yet billed and ``counters``."""

    token: int
    role: Role
    entropy: float
    counters: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Draft:
    """Append ``token`` to the sequence without emitting it (a speculative draft, judged later)."""

    token: int


@dataclass(frozen=True)
class Rollback:
    """Keep the first ``keep`` tokens of the sequence; each model keeps at most ``seen`` of them cached
    (``(role, positions)`` pairs): what it must re-read is fed again at its next pass."""

    keep: int
    seen: tuple[tuple[Role, int], ...]
    moves: tuple[tuple[Role, int, int], ...] = ()
    """``(role, from, to)``: positions whose cached keys and values (and features) move first: a sibling read after
    the row's end, to the position its token now holds."""


@dataclass(frozen=True)
class Fork:
    """Start a new path from the sequence as it is (before this step's ``Emit``), whose first token is
    ``token``, written by ``role``."""

    token: int
    role: Role
    entropy: float
    counters: tuple[tuple[str, int], ...] = ()


Action = Emit | Draft | Rollback | Fork


# -- what a decoder reads of a pass, and what it hands the rejection sampler


@quick_init
@dataclass(frozen=True)
class Read:
    """What a sequence needs from the next step: logits of ``role`` at its next position, or, with
    ``verify``, at the position before each of its ``drafts`` and one more."""

    role: Role
    verify: bool = False
    drafts: int = 0
    siblings: tuple[int, ...] = ()
    """With ``verify``: another token for each of the first drafts (the draft model's second choice), each read in
    the same pass at its draft's position over the tokens before it (a tree of one chain and its leaves); the pass
    returns the large model's logits after each, when it can attend to them (see :class:`RoundVerdict.extra`)."""
    chain: int = 0
    """Greedy drafts: how many tokens the decoder will take from ``role`` one after another from here, each its
    argmax, none able to change its course but an end of text (the rest of a round). The scheduler reserves room
    for them all, and when every row of a pass has a chain the engine runs their passes back to back, without a
    step between, each decoder taking each token as it comes; 0: a token drawn by the sampler, then the next step."""

    @property
    def positions(self) -> int:
        """Positions whose logits the pass returns for this sequence."""
        return self.drafts + 1 if self.verify else 1


@quick_init
@dataclass(frozen=True)
class TokenSample:
    """One sequence's row of a pass, sampled."""

    role: Role
    token: int
    """Drawn under the sequence's sampling settings (argmax when greedy)."""
    entropy: float
    """Bits, of the raw logits."""
    logits: torch.Tensor | None
    """[V] raw logits (a view into the pass's output; a draft keeps it for its verification); None where no decoder
    of the pass reads them (:attr:`ead_llm.core.policy.Decoder.reads_logits`)."""
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
    extra: int | None = None
    """Greedy rounds with siblings: when the closing ``token`` is the sibling read at its position, the large
    model's next token after it (read at that sibling), which the round emits too; None otherwise."""
    extra_entropy: float = 0.0
    """Bits of the large model's logits ``extra`` was read from."""


@dataclass(frozen=True)
class DraftRound:
    """What the rejection sampler needs of one sequence's round."""

    tokens: tuple[int, ...]
    logits: tuple[torch.Tensor, ...]
    """[V] raw logits each draft was drawn from."""
    entropies: tuple[float, ...]
    first_position: int
    """Position of the first draft in the sequence."""
    siblings: tuple[int, ...] = ()
    """The tokens read beside the first drafts (:attr:`Read.siblings`)."""
    entropy_threshold: float = math.inf
    top_n: int = 1
    overlap_threshold: float = 1.0
    oracle: bool = False
