"""One model's paged KV cache: fixed-size blocks from a pool, a block table per sequence.

Memory follows the tokens held. Every layer stores keys and values token-major in one tensor
``[capacity_tokens, kv_heads, head_dim]``; a sequence owns a list of blocks of ``block_size``
positions (its block table) and a length. Position ``p`` of a sequence lives at flat slot
``blocks[p // block_size] * block_size + p % block_size``. The pool grows (by doubling, up to
``max_tokens``) only when blocks run out, and is released when nothing is held.

A fork (an EAGER path branching off another) shares its parent's blocks; a block is copied only
when a sequence writes into a block that someone else also holds (copy on write). A rollback
(rejected speculative drafts) shortens the length and frees the blocks past it.

The scheduler asks for blocks (``reserve``) before a pass; the model runner writes the pass's new
keys and values (``write``) and reads each row's history (``gather``) inside the attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ead_llm.core.validation import check_int

DEFAULT_BLOCK_SIZE = 16
MIN_BLOCKS = 16
"""Blocks the pool starts with when it has no budget (it doubles from there)."""


@dataclass(eq=False)
class SequenceKV:
    """One sequence's cache in one model: its block table and how many positions are written."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    """Positions the model has seen (written); the rest of the sequence is fed at its next pass."""
    evicted: int = 0
    """Positions it had seen when its blocks were taken back (a preemption): feeding them again is recomputation."""


class OutOfBlocks(RuntimeError):
    """The pool has no free block left within its budget."""


class BlockPool:
    """Which blocks are free and how many sequences hold each one (pure bookkeeping, no tensors)."""

    def __init__(self, max_blocks: int | None) -> None:
        self.max_blocks = max_blocks
        self.num_blocks = 0
        self.free: list[int] = []
        self.refs: list[int] = []

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def available(self) -> int | None:
        """Blocks that can still be handed out (None: no limit)."""
        if self.max_blocks is None:
            return None
        return len(self.free) + self.max_blocks - self.num_blocks

    def allocate(self) -> int:
        if not self.free:
            self._grow()
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def reset(self) -> None:
        self.num_blocks, self.free, self.refs = 0, [], []

    def _grow(self) -> None:
        target = max(MIN_BLOCKS, 2 * self.num_blocks)
        if self.max_blocks is not None:
            target = min(target, self.max_blocks)
        if target <= self.num_blocks:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.free.extend(range(target - 1, self.num_blocks - 1, -1))
        self.refs.extend([0] * (target - self.num_blocks))
        self.num_blocks = target


class KVCache:
    """The paged keys and values of one model for every sequence it serves."""

    def __init__(self, layers: int, *, block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int | None = None) -> None:
        self.layers = check_int("layers", layers, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1)
        if max_tokens is not None:
            check_int("max_tokens", max_tokens, minimum=1)
        self.pool = BlockPool(None if max_tokens is None else math.ceil(max_tokens / block_size))
        self.keys: list[torch.Tensor | None] = [None] * layers  # per layer: [capacity, H, D]
        self.values: list[torch.Tensor | None] = [None] * layers
        self.peak_blocks = 0
        """Most blocks held at once since the cache was made (what the memory had to cover)."""
        self.peak_nbytes = 0
        """Most bytes of storage allocated at once since the cache was made."""

    # -- bookkeeping (the scheduler) ---------------------------------------------------------------

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def can_hold(self, extra_blocks: int) -> bool:
        """Whether ``extra_blocks`` more blocks can be handed out now."""
        available = self.pool.available()
        return available is None or extra_blocks <= available

    def reserve(self, seq: SequenceKV, length: int) -> None:
        """Give ``seq`` blocks for positions up to ``length``, and a private copy of any shared block
        it will write into; raises :class:`OutOfBlocks` (holding what it already had) when full."""
        if length <= seq.length:
            return
        first = seq.length // self.block_size
        if first < len(seq.blocks) and self.pool.refs[seq.blocks[first]] > 1:
            private = self.pool.allocate()
            self._copy_block(seq.blocks[first], private)
            self.pool.release(seq.blocks[first])
            seq.blocks[first] = private
        while len(seq.blocks) < self.blocks_for(length):
            seq.blocks.append(self.pool.allocate())
        self.peak_blocks = max(self.peak_blocks, self.pool.used)

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A sequence sharing ``seq``'s blocks and length (copied block by block only when written)."""
        for block in seq.blocks:
            self.pool.share(block)
        return SequenceKV(blocks=list(seq.blocks), length=seq.length)

    def truncate(self, seq: SequenceKV, length: int) -> None:
        """Roll ``seq`` back to its first ``length`` positions, freeing the blocks past them."""
        seq.length = min(seq.length, length)
        keep = self.blocks_for(seq.length)
        for block in seq.blocks[keep:]:
            self.pool.release(block)
        del seq.blocks[keep:]

    def free(self, seq: SequenceKV) -> None:
        """Release all of ``seq``'s blocks."""
        self.truncate(seq, 0)

    def trim(self) -> None:
        """Release the storage when no sequence holds a block (memory follows the tokens held)."""
        if self.pool.used == 0:
            self.clear()

    def clear(self) -> None:
        """Forget every block and the storage (after a fault failed every sequence: nothing is held)."""
        self.pool.reset()
        self.keys = [None] * self.layers
        self.values = [None] * self.layers

    @property
    def tokens_held(self) -> int:
        return self.pool.used * self.block_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    # -- tensors (the model runner) ------------------------------------------------------------------

    def slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slots of ``positions`` ``[B, N]`` in the sequences whose block tables are ``tables`` ``[B, M]``."""
        blocks = torch.gather(tables, 1, torch.div(positions, self.block_size, rounding_mode="floor"))
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``[T, H, D]`` of one layer at flat ``slots`` ``[T]``."""
        capacity = self.pool.num_blocks * self.block_size
        stored = self.keys[layer]
        if stored is None or stored.shape[0] < capacity:
            self.keys[layer] = _fit(stored, capacity, keys)
            self.values[layer] = _fit(self.values[layer], capacity, values)
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes())
        self.keys[layer][slots] = keys  # type: ignore[index]
        self.values[layer][slots] = values  # type: ignore[index]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, L, D]`` of one layer at flat ``slots`` ``[B, L]``."""
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None, "gather before any write"
        batch, length = slots.shape
        flat = slots.reshape(-1)
        k = keys.index_select(0, flat).view(batch, length, *keys.shape[1:]).transpose(1, 2)
        v = values.index_select(0, flat).view(batch, length, *values.shape[1:]).transpose(1, 2)
        return k, v

    def view(self, layer: int, span: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, H, L, D]`` of one layer at the consecutive flat slots ``span`` (no copy)."""
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None, "view before any write"
        return keys[span].transpose(0, 1)[None], values[span].transpose(0, 1)[None]

    def _copy_block(self, source: int, target: int) -> None:
        size = self.block_size
        for tensors in (self.keys, self.values):
            for layer, tensor in enumerate(tensors):
                if tensor is None:
                    continue
                tensors[layer] = tensor = _fit(tensor, self.pool.num_blocks * size, tensor)
                tensor[target * size : (target + 1) * size] = tensor[source * size : (source + 1) * size]


def _fit(storage: torch.Tensor | None, capacity: int, like: torch.Tensor) -> torch.Tensor:
    """``storage`` grown to ``capacity`` rows (its contents kept), or a new tensor shaped like ``like``'s rows."""
    if storage is not None and storage.shape[0] >= capacity:
        return storage
    grown = torch.empty((capacity, *like.shape[1:]), dtype=like.dtype, device=like.device)
    if storage is not None:
        grown[: storage.shape[0]] = storage
    return grown
