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
from typing import Any

import torch
from transformers import DynamicCache

from ead_llm.core.loading import LoadedModel
from ead_llm.core.types import ForwardWork, Role
from ead_llm.core.validation import check_int

MIN_CAPACITY = 64
"""Positions per slot allocated at first use; capacity doubles as sequences grow."""


class KVPool:
    """One model's keys and values for every sequence slot (allocated on first write)."""

    def __init__(self, slots: int, max_positions: int | None, layers: int) -> None:
        self.slots = check_int("slots", slots, minimum=1)
        self.max_positions = max_positions
        self.layers = layers
        self.keys: list[torch.Tensor] = []  # per layer: [S, H, C, D]
        self.values: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, index: WriteIndex) -> None:
        """Store the real new positions of ``keys``/``values`` (``[B, H, N, D]``) of one layer."""
        if not self.keys:
            self._allocate(keys, values, index.needed)
        elif layer == 0:
            self._grow(index.needed)
        self.keys[layer][index.slots, :, index.positions] = keys[index.rows, :, index.cols]
        self.values[layer][index.slots, :, index.positions] = values[index.rows, :, index.cols]

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``source`` into slot ``target`` (a branched path)."""
        for tensors in (self.keys, self.values):
            for tensor in tensors:
                tensor[target, :, :length] = tensor[source, :, :length]

    def read(
        self, layer: int, rows: torch.Tensor, span: slice | None, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, length, D]`` of one layer for the group's slots: a view when the
        slots are one ascending run (``span``), else a gathered copy."""
        k, v = self.keys[layer], self.values[layer]
        if span is not None:
            return k[span, :, :length], v[span, :, :length]
        return k[rows, :, :length], v[rows, :, :length]

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        layers = self.layers
        capacity = self._capacity_for(needed)
        k_shape = (self.slots, keys.shape[1], capacity, keys.shape[3])
        v_shape = (self.slots, values.shape[1], capacity, values.shape[3])
        self.keys = [torch.zeros(k_shape, dtype=keys.dtype, device=keys.device) for _ in range(layers)]
        self.values = [torch.zeros(v_shape, dtype=values.dtype, device=values.device) for _ in range(layers)]

    def _capacity_for(self, needed: int) -> int:
        capacity = max(MIN_CAPACITY, self.capacity)
        while capacity < needed:
            capacity *= 2
        if self.max_positions is not None:
            capacity = max(needed, min(capacity, self.max_positions))
        return capacity

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = self._capacity_for(needed)
        for tensors in (self.keys, self.values):
            for layer, old in enumerate(tensors):
                grown = torch.zeros((*old.shape[:2], capacity, old.shape[3]), dtype=old.dtype, device=old.device)
                grown[:, :, : old.shape[2]] = old
                tensors[layer] = grown


@dataclass(frozen=True)
class WriteIndex:
    """Where a forward pass's real new positions go: row ``rows[k]``'s column ``cols[k]`` is stored
    in slot ``slots[k]`` at position ``positions[k]``."""

    rows: torch.Tensor
    cols: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    needed: int
    """Positions every slot must hold after the write."""


class PoolCache(DynamicCache):
    """The cache a model sees for one batched pass: writes go to the pool, reads come from it.

    ``update`` stores the layer's new keys and values at each row's true positions and returns the
    group's keys and values up to the longest row; the 4D mask (built by the runner from true
    positions) hides what a row must not see. Nothing is concatenated.
    """

    def __init__(self, pool: KVPool, rows: torch.Tensor, span: slice | None, index: WriteIndex, length: int) -> None:
        super().__init__()
        self.pool, self.rows, self.span, self.index, self.length = pool, rows, span, index, length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.pool.write(layer_idx, key_states, value_states, self.index)
        return self.pool.read(layer_idx, self.rows, self.span, self.length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


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


def check_full_attention(source: str, config: Any) -> None:
    """Refuse models with sliding-window or linear-attention layers: the pooled cache keeps every
    position and the runner's mask lets a token see all earlier ones, which those layers must not."""
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        raise ValueError(
            f"{source}: layers of kind {sorted(kinds - {'full_attention'})} are not supported "
            "(ead-llm's KV pool serves full-attention models only)"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(f"{source}: sliding-window attention is not supported (ead-llm serves full-attention models)")


class ModelRunner:
    """Runs one model of the pair over a group of sequences in one batched forward pass."""

    def __init__(
        self, loaded: LoadedModel, device: torch.device, vocab_size: int, slots: int, max_positions: int | None
    ) -> None:
        self.role: Role = loaded.role
        self.model = loaded.model
        check_full_attention(loaded.info.source, self.model.config)
        self.device = device
        self.vocab_size = vocab_size
        self.pool = KVPool(slots, max_positions, self.model.config.num_hidden_layers)
        self._dtype: torch.dtype = getattr(self.model, "dtype", torch.float32)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(self, rows: Sequence[ForwardRow]) -> tuple[torch.Tensor, list[ForwardWork]]:
        """Next-token logits [B, V] (float32, on the model's device, in ``rows`` order) and the work per row."""
        logits, order, counts, work = self._run(rows)  # logits: [B, N, V] in slot order
        batch = len(rows)
        picked = logits[torch.arange(batch, device=logits.device), counts - 1]  # [B, V]
        out = torch.empty_like(picked)
        out[torch.tensor(order, device=picked.device)] = picked
        return out, work

    def forward_all(self, rows: Sequence[ForwardRow]) -> tuple[list[torch.Tensor], list[ForwardWork]]:
        """Logits at every new position of each row (``[n_i, V]``, in ``rows`` order: what verifying
        drafts needs) and the work per row."""
        logits, order, counts, work = self._run(rows)
        per_row: list[torch.Tensor] = [logits[0, :0]] * len(rows)
        for b, i in enumerate(order):
            per_row[i] = logits[b, : int(counts[b])]  # [n_i, V]
        return per_row, work

    def _run(self, rows: Sequence[ForwardRow]) -> tuple[torch.Tensor, list[int], torch.Tensor, list[ForwardWork]]:
        """One batched pass: logits ``[B, N, V]`` with rows in slot order, that order, each row's new-token
        count (slot order), and the work per row (``rows`` order)."""
        news = [list(row.tokens[row.cache.seen :]) for row in rows]
        if any(not new for new in news):
            raise RuntimeError("the runner was asked for logits with no new token to feed")
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)  # slot order: a run of slots is a view
        device = self.device
        batch, width = len(rows), max(len(new) for new in news)
        slot_list = [rows[i].slot for i in order]
        slots = torch.tensor(slot_list, dtype=torch.long, device=device)  # [B]
        starts = torch.tensor([rows[i].cache.seen for i in order], dtype=torch.long, device=device)  # [B]
        counts = torch.tensor([len(news[i]) for i in order], dtype=torch.long, device=device)  # [B]
        input_ids = torch.zeros((batch, width), dtype=torch.long, device=device)  # [B, N], right-padded
        for b, i in enumerate(order):
            input_ids[b, : len(news[i])] = torch.tensor(news[i], dtype=torch.long)
        offsets = torch.arange(width, device=device)
        # a pad repeats its row's last real position: a valid position id, and it sees what that token sees
        last_visible = starts[:, None] + torch.minimum(offsets[None, :], counts[:, None] - 1)  # [B, N]
        length = int((starts + counts).max())
        keys = torch.arange(length, device=device)
        visible = keys[None, None, :] <= last_visible[:, :, None]  # [B, N, L]: true positions, causal
        mask = torch.zeros((batch, 1, width, length), dtype=self._dtype, device=device)  # additive
        mask.masked_fill_(~visible[:, None], torch.finfo(self._dtype).min)
        rows_idx, cols_idx = torch.nonzero(offsets[None, :] < counts[:, None], as_tuple=True)
        index = WriteIndex(rows_idx, cols_idx, slots[rows_idx], starts[rows_idx] + cols_idx, length)
        span = slice(slot_list[0], slot_list[0] + batch) if slot_list[-1] - slot_list[0] == batch - 1 else None
        cache = PoolCache(self.pool, slots, span, index, length)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=last_visible,
            cache_position=torch.arange(length - width, length, device=device),
            use_cache=True,
            logits_to_keep=width,
            **{self._cache_kwarg: cache},
        )
        logits = out.logits[:, :, : self.vocab_size].float()  # [B, N, V], slot order
        work = []
        for row, new in zip(rows, news, strict=True):
            work.append(ForwardWork(self.role, len(new), row.cache.seen))
            row.cache.seen += len(new)
        return logits, order, counts, work
