"""Sampling settings of one request and the sampler that turns logits into a token."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

import torch

from ead_llm.ops import sample_token
from ead_llm.validation import check_float, check_int, check_stop


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    temperature: float = 0.0
    """0 is greedy; otherwise logits are divided by it before sampling."""
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

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature, minimum=0.0, maximum=100.0)
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


def request_generator(seed: int | None, row: int) -> torch.Generator:
    """A CPU generator for row ``row`` of a request: the same (seed, row) always gives the same draws."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.manual_seed(secrets.randbits(63))
    else:
        generator.manual_seed((seed * 1_000_003 + row) % (2**63))
    return generator


class Sampler:
    """Turns one row of next-token logits into a token id under a request's settings."""

    def sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        """``logits``: [V] raw logits of the producing model."""
        return sample_token(
            logits,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            generator=generator,
        )
