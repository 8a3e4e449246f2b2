"""Sampling settings of one request and the sampler that turns logits into a token."""

from __future__ import annotations

import secrets

import torch

from ead_llm.core.ops import sample_token
from ead_llm.core.request import SamplingParams


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
