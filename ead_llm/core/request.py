"""What a caller asks for and what it gets back: requests, sampling settings, completions."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ead_llm.accounting.ledger import Cost
from ead_llm.core.policy import Policy, check_policy
from ead_llm.core.types import FinishReason, Role
from ead_llm.core.validation import check_float, check_int, check_stop, check_text

if TYPE_CHECKING:
    import torch

    from ead_llm.core.grammar import Constraint

Prompt = str | Sequence[int]
MAX_TEMPERATURE = 2.0


class PromptTooLongError(ValueError):
    """A prompt longer than the models' context (with ``prompt_truncation="error"``)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    temperature: float = 0.0
    """0 is greedy; otherwise logits are divided by it before sampling. At most 2, the range OpenAI's API
    and DSPy's canonical requests accept, so a setting means the same through every door."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""
    max_tokens: int = 256
    """Most tokens to generate (>= 1)."""
    stop: tuple[str, ...] = field(default=())
    """Strings that end the completion; they are matched on decoded text and not returned."""
    seed: int | None = 0
    """Seed of this request's random generator; None draws a fresh one."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks that need a fixed length)."""
    prompt_truncation: Literal["error", "left"] = "error"
    """A prompt that does not fit the context: ``error`` (the default) refuses it; ``left`` drops its
    oldest tokens (keeping a leading BOS) so that it and ``max_tokens`` fit."""
    constraint: Constraint | None = None
    """What every generated token must obey (:class:`ead_llm.core.grammar.Constraint`: a JSON schema, a
    regex, a Lark grammar), whichever model writes it; None: free text."""

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature, minimum=0.0, maximum=MAX_TEMPERATURE)
        check_float("top_p", self.top_p, minimum=0.0, maximum=1.0, exclusive_minimum=True)
        check_int("top_k", self.top_k, minimum=0)
        check_int("max_tokens", self.max_tokens, minimum=1)
        object.__setattr__(self, "stop", check_stop(self.stop))
        if self.seed is not None:
            check_int("seed", self.seed, minimum=0, maximum=2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.prompt_truncation not in ("error", "left"):
            raise ValueError(f"prompt_truncation must be 'error' or 'left', got {self.prompt_truncation!r}")
        if self.constraint is not None:
            from ead_llm.core.grammar import Constraint

            if not isinstance(self.constraint, Constraint):
                raise ValueError(
                    "constraint must be a Constraint (Constraint.json_schema(...), Constraint.regex(...)), "
                    f"got {self.constraint!r}"
                )
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a constraint: a finished grammar allows only EOS")


@dataclass(frozen=True)
class Request:
    """One prompt to complete, with its policy and sampling settings."""

    prompt: Prompt
    policy: Policy
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample_index: int | None = None
    """Which of the seed's random streams this request draws from (None: stream 0). The k-th of n samples
    of one prompt uses stream k, whichever way the n are asked for; a request's place in its call never
    matters, so a prompt gives the same text alone or anywhere in a batch."""

    def __post_init__(self) -> None:
        if isinstance(self.prompt, str):
            check_text("prompt", self.prompt)
        else:
            try:
                ids = tuple(self.prompt)
            except TypeError:
                raise ValueError(f"prompt must be a string or a list of token ids, got {self.prompt!r}") from None
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError("prompt token ids must be integers")
            object.__setattr__(self, "prompt", ids)
        check_policy(self.policy)
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if self.sample_index is not None:
            check_int("sample_index", self.sample_index, minimum=0)


@dataclass(frozen=True)
class Completion:
    """The one result type: a finished sequence with its tokens, provenance and cost."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    roles: tuple[Role, ...]
    """Which model emitted each token."""
    entropies: tuple[float, ...]
    """Entropy (bits, raw logits) of the distribution each token was drawn from."""
    finish_reason: FinishReason
    cost: Cost
    path: int = 0
    """Which path this is (EAGER: the one the vote chose)."""
    paths: int = 1
    """How many paths the request ran (EAGER)."""
    votes: dict[str, int] | None = None
    """EAGER's vote counts by extracted answer."""
    hidden_states: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """From an engine built with ``return_hidden_states=True``: the large model's final hidden state at every
    position fed to it (see :attr:`~ead_llm.core.types.TokenEvent.hidden_states`)."""


def sequence_key(prompt_ids: Sequence[int], sample_index: int) -> int:
    """A stable 63-bit key of a sequence (its prompt's ids and its explicit sample index), the same in
    every process and wherever the request sits in a batch: per-sequence policy randomness is keyed on it."""
    digest = hashlib.sha256(f"{sample_index}:{','.join(map(str, prompt_ids))}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
