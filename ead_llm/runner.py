"""The model runner: executes forward passes over sequences' KV caches and returns next-token logits."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ead_llm.loading import LoadedModel
from ead_llm.types import ForwardWork, Role


class ModelCache:
    """One model's KV cache for one sequence, and how many of the sequence's tokens it holds.

    ``seen`` tokens of the sequence are in ``kv``; the runner feeds the rest (the gap) in one
    forward pass the next time this model is asked for logits.
    """

    def __init__(self) -> None:
        self.kv: DynamicCache | None = None
        self.seen = 0

    def release(self) -> None:
        """Free the cached keys and values."""
        self.kv = None
        self.seen = 0


@dataclass
class ForwardRow:
    """A request for next-token logits of one sequence from one model."""

    cache: ModelCache
    tokens: Sequence[int]
    """The whole sequence so far (prompt and generated); the model has seen ``cache.seen`` of them."""


class ModelRunner:
    """Runs one model of the pair over rows of sequences.

    ``forward(rows)`` catches each row's cache up on the tokens it has not seen (the prompt on
    first use, the gap after a switch, or the last emitted token) and returns the logits of the
    next token. Rows are independent; today each runs as its own pass, the interface already
    takes a batch so that a batched implementation can replace the loop.
    """

    def __init__(self, loaded: LoadedModel, device: torch.device, vocab_size: int) -> None:
        self.role: Role = loaded.role
        self.model = loaded.model
        self.device = device
        self.vocab_size = vocab_size
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _new_cache(self) -> DynamicCache:
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    def forward(self, rows: Sequence[ForwardRow]) -> tuple[torch.Tensor, list[ForwardWork]]:
        """Next-token logits [B, V] (float32, on the model's device) and the work done per row."""
        logits: list[torch.Tensor] = []
        work: list[ForwardWork] = []
        for row in rows:
            row_logits, row_work = self._forward_one(row)
            logits.append(row_logits)
            work.append(row_work)
        return torch.stack(logits), work

    def _forward_one(self, row: ForwardRow) -> tuple[torch.Tensor, ForwardWork]:
        cache = row.cache
        new = list(row.tokens[cache.seen :])
        if not new:
            raise RuntimeError("the runner was asked for logits with no new token to feed")
        if cache.kv is None:
            cache.kv = self._new_cache()
        past = cache.seen
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # [1, T]
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache.kv})
        cache.seen = len(row.tokens)
        return out.logits[0, -1, : self.vocab_size].float(), ForwardWork(self.role, len(new), past)
