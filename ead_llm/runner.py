"""The model runner: one batched forward pass per group of sequences, over a pooled KV cache.

Each model keeps a :class:`KVPool`: per layer, keys and values for every sequence slot,
``[slots, kv_heads, capacity, head_dim]``, each slot's positions stored from 0. A forward pass for
a group of sequences gathers their slots up to the longest one, feeds every row's unseen tokens
(one for a decode, several for a catch-up after a switch; rows padded on the right), masks each
row's unused positions, gives each token its true position id, and writes the new keys and values
back into the slots. Rows never see each other: the same sequence gets the same logits (up to
floating-point rounding of batched kernels) whatever else is in the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ead_llm.loading import LoadedModel
from ead_llm.types import ForwardWork, Role
from ead_llm.validation import check_int

MIN_CAPACITY = 64
"""Positions per slot allocated at first use; capacity doubles as sequences grow."""


class KVPool:
    """One model's keys and values for every sequence slot (allocated on first write)."""

    def __init__(self, slots: int, max_positions: int | None) -> None:
        self.slots = check_int("slots", slots, minimum=1)
        self.max_positions = max_positions
        self.keys: list[torch.Tensor] = []  # per layer: [S, H, C, D]
        self.values: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def _ensure(self, needed: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Grow every slot to hold ``needed`` positions (doubling), allocating from ``like``'s shapes."""
        if needed <= self.capacity:
            return
        capacity = max(MIN_CAPACITY, self.capacity)
        while capacity < needed:
            capacity *= 2
        if self.max_positions is not None:
            capacity = max(needed, min(capacity, self.max_positions))
        grown_keys, grown_values = [], []
        for layer, (k, v) in enumerate(like):
            shape = (self.slots, k.shape[1], capacity, k.shape[3])
            new_k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            new_v = torch.zeros((self.slots, v.shape[1], capacity, v.shape[3]), dtype=v.dtype, device=v.device)
            if self.keys:
                new_k[:, :, : self.capacity] = self.keys[layer]
                new_v[:, :, : self.capacity] = self.values[layer]
            grown_keys.append(new_k)
            grown_values.append(new_v)
        self.keys, self.values = grown_keys, grown_values

    def gather(self, slots: torch.Tensor, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values of ``slots`` up to ``length``: ``[B, H, length, D]`` copies."""
        return [(k[slots, :, :length], v[slots, :, :length]) for k, v in zip(self.keys, self.values, strict=True)]

    def write(
        self,
        slots: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        new: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Store row ``i``'s first ``counts[i]`` new positions of ``new`` (per layer ``[B, H, N, D]``)
        in slot ``slots[i]`` from position ``starts[i]``."""
        self._ensure(int((starts + counts).max()), new)
        width = new[0][0].shape[2]
        offsets = torch.arange(width, device=counts.device)
        rows, cols = torch.nonzero(offsets[None, :] < counts[:, None], as_tuple=True)  # the real new positions
        target_slots, target_positions = slots[rows], starts[rows] + cols
        for layer, (k, v) in enumerate(new):
            self.keys[layer][target_slots, :, target_positions] = k[rows, :, cols]
            self.values[layer][target_slots, :, target_positions] = v[rows, :, cols]


class ModelCache:
    """How many of a sequence's tokens one model has in its slot of the pool.

    The runner feeds the rest (the gap) the next time this model is asked for logits.
    """

    def __init__(self) -> None:
        self.seen = 0

    def release(self) -> None:
        """Forget the cached positions (the slot's memory is reused by the next sequence)."""
        self.seen = 0


@dataclass
class ForwardRow:
    """A request for next-token logits of one sequence from one model."""

    slot: int
    cache: ModelCache
    tokens: Sequence[int]
    """The whole sequence so far (prompt and generated); the model has seen ``cache.seen`` of them."""


class ModelRunner:
    """Runs one model of the pair over a group of sequences in one batched forward pass."""

    def __init__(
        self, loaded: LoadedModel, device: torch.device, vocab_size: int, slots: int, max_positions: int | None
    ) -> None:
        self.role: Role = loaded.role
        self.model = loaded.model
        self.device = device
        self.vocab_size = vocab_size
        self.pool = KVPool(slots, max_positions)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _cache(self, past: list[tuple[torch.Tensor, torch.Tensor]] | None) -> DynamicCache:
        try:
            return DynamicCache(ddp_cache_data=past, config=self.model.config)
        except TypeError:
            return DynamicCache(ddp_cache_data=past)

    def forward(self, rows: Sequence[ForwardRow]) -> tuple[torch.Tensor, list[ForwardWork]]:
        """Next-token logits [B, V] (float32, on the model's device) and the work done per row."""
        news = [list(row.tokens[row.cache.seen :]) for row in rows]
        if any(not new for new in news):
            raise RuntimeError("the runner was asked for logits with no new token to feed")
        seen = [row.cache.seen for row in rows]
        batch, past_len, width = len(rows), max(seen), max(len(new) for new in news)
        device = self.device
        slots = torch.tensor([row.slot for row in rows], dtype=torch.long, device=device)  # [B]
        starts = torch.tensor(seen, dtype=torch.long, device=device)  # [B]
        counts = torch.tensor([len(new) for new in news], dtype=torch.long, device=device)  # [B]
        input_ids = torch.zeros((batch, width), dtype=torch.long, device=device)  # [B, N], right-padded
        for i, new in enumerate(news):
            input_ids[i, : len(new)] = torch.tensor(new, dtype=torch.long)
        offsets = torch.arange(width, device=device)
        # pads repeat the row's last real position (a valid position id; their outputs are ignored)
        position_ids = starts[:, None] + torch.minimum(offsets[None, :], counts[:, None] - 1)  # [B, N]
        past_mask = torch.arange(past_len, device=device)[None, :] < starts[:, None]  # [B, P]
        # every new position is attendable: causality keeps real tokens off the later pads
        attention_mask = torch.cat([past_mask, torch.ones((batch, width), dtype=torch.bool, device=device)], dim=1)
        cache = self._cache(self.pool.gather(slots, past_len) if past_len else None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids,
            cache_position=torch.arange(past_len, past_len + width, device=device),
            use_cache=True,
            logits_to_keep=width,
            **{self._cache_kwarg: cache},
        )
        new_kv = [(layer.keys[:, :, past_len:], layer.values[:, :, past_len:]) for layer in cache.layers]  # type: ignore[union-attr,index]
        self.pool.write(slots, starts, counts, new_kv)
        logits = out.logits[torch.arange(batch, device=device), counts - 1, : self.vocab_size].float()  # [B, V]
        work = []
        for row, past, new in zip(rows, seen, news, strict=True):
            row.cache.seen = past + len(new)
            work.append(ForwardWork(self.role, len(new), past))
        return logits, work
