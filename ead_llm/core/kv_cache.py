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

Prefix caching (the scheduler matches at admission and commits each step): a full block whose tokens are final
is registered (``commit``) under the hash chain of the tokens up to its end, so that another sequence
starting with the same tokens shares it (``match``) instead of computing it again. A registered block that
nobody holds stays cached (idle, least recently used first) until a block is needed and none is free; a
registered block is never written again (a sequence that would write into it gets a private copy).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
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
    hashes: list[int] = field(default_factory=list)
    """Chain hashes of its full blocks of final tokens (prefix caching: computed once per block)."""
    cached: int = 0
    """Positions it took from the prefix cache instead of computing them."""


class OutOfBlocks(RuntimeError):
    """The pool has no free block left within its budget."""


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = 0, start: int = 0) -> list[int]:
    """The hash chain of ``tokens``' full blocks from block ``start`` (whose predecessor's hash is ``parent``):
    block ``i``'s hash covers every token up to its end, so two sequences share block ``i`` only when their
    first ``(i + 1) * block_size`` tokens agree."""
    out = []
    for begin in range(start * block_size, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[begin : begin + block_size])))
        out.append(parent)
    return out


class BlockPool:
    """Which blocks are free, how many sequences hold each one, and which full blocks are cached by the hash of
    their token chain (pure bookkeeping, no tensors)."""

    def __init__(self, max_blocks: int | None) -> None:
        self.max_blocks = max_blocks
        self.num_blocks = 0
        self.free: list[int] = []
        self.refs: list[int] = []
        self.by_hash: dict[int, int] = {}
        """Cached full blocks by the hash of their token chain."""
        self.hash_of: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()
        """Cached blocks nobody holds, least recently used first: taken back only when no block is free."""
        self.evictions = 0

    @property
    def used(self) -> int:
        """Blocks some sequence holds (idle cached blocks are not)."""
        return self.num_blocks - len(self.free) - len(self.idle)

    def available(self) -> int | None:
        """Blocks that can still be handed out (None: no limit)."""
        if self.max_blocks is None:
            return None
        return len(self.free) + len(self.idle) + self.max_blocks - self.num_blocks

    def allocate(self) -> int:
        """A block for one holder: a free one, else the least recently used idle cached one (forgotten), else
        a new one."""
        if not self.free and self.idle:
            block, _ = self.idle.popitem(last=False)
            self.forget(block)
            self.evictions += 1
        else:
            if not self.free:
                self._grow()
            block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:  # an idle cached block comes back into use
            del self.idle[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.idle[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, chain_hash: int) -> None:
        """Cache a held full block under its chain hash (a hash already cached keeps its block)."""
        if chain_hash not in self.by_hash and block not in self.hash_of:
            self.by_hash[chain_hash] = block
            self.hash_of[block] = chain_hash

    def forget(self, block: int) -> None:
        """Drop a block from the cache (its contents are about to change)."""
        chain_hash = self.hash_of.pop(block, None)
        if chain_hash is not None:
            del self.by_hash[chain_hash]

    def reset(self) -> None:
        self.num_blocks, self.free, self.refs = 0, [], []
        self.by_hash, self.hash_of, self.idle = {}, {}, OrderedDict()

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
        if first < len(seq.blocks) and (
            self.pool.refs[seq.blocks[first]] > 1 or seq.blocks[first] in self.pool.hash_of
        ):
            private = self.pool.allocate()
            self._copy_block(seq.blocks[first], private)
            self.pool.release(seq.blocks[first])
            seq.blocks[first] = private
        while len(seq.blocks) < self.blocks_for(length):
            seq.blocks.append(self.pool.allocate())
        self.peak_blocks = max(self.peak_blocks, self.pool.used)

    def _shared(self, block: int) -> bool:
        """Whether writing into ``block`` would change what someone else reads (another holder, or the cache)."""
        return self.pool.refs[block] > 1 or block in self.pool.hash_of

    def match(self, seq: SequenceKV, tokens: Sequence[int]) -> int:
        """Give an empty ``seq`` the cached blocks that hold ``tokens``' longest cached prefix of full blocks (all
        but the last token at most, whose logits the next pass needs); returns the positions now held."""
        if seq.blocks or seq.length:
            raise ValueError("match a sequence before it holds anything")
        for chain_hash in block_hashes(tokens[: max(0, len(tokens) - 1)], self.block_size):
            block = self.pool.by_hash.get(chain_hash)
            if block is None:
                break
            if block in self.pool.idle:
                self.pool.idle.move_to_end(block)
            self.pool.share(block)
            seq.blocks.append(block)
            seq.hashes.append(chain_hash)
        seq.length = len(seq.blocks) * self.block_size
        seq.cached += seq.length
        return seq.length

    def commit(self, seq: SequenceKV, tokens: Sequence[int]) -> None:
        """Cache ``seq``'s full blocks written so far, whose final tokens are ``tokens`` (a prefix of the
        sequence's tokens, at least ``seq.length`` long: drafts a verification may still reject are not final)."""
        final = min(seq.length, len(tokens))
        done = len(seq.hashes)
        if (done + 1) * self.block_size > final:
            return
        parent = seq.hashes[-1] if seq.hashes else 0
        for index, chain_hash in enumerate(block_hashes(tokens[:final], self.block_size, parent, done), start=done):
            self.pool.register(seq.blocks[index], chain_hash)
            seq.hashes.append(chain_hash)

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A sequence sharing ``seq``'s blocks and length (copied block by block only when written)."""
        for block in seq.blocks:
            self.pool.share(block)
        return SequenceKV(blocks=list(seq.blocks), length=seq.length, hashes=list(seq.hashes))

    def truncate(self, seq: SequenceKV, length: int) -> None:
        """Roll ``seq`` back to its first ``length`` positions, freeing the blocks past them (a cached block it
        keeps in part is copied before it is written again)."""
        seq.length = min(seq.length, length)
        del seq.hashes[seq.length // self.block_size :]  # a block cut into holds other tokens from now on
        keep = self.blocks_for(seq.length)
        for block in seq.blocks[keep:]:
            self.pool.release(block)
        del seq.blocks[keep:]

    def free(self, seq: SequenceKV) -> None:
        """Release all of ``seq``'s blocks."""
        self.truncate(seq, 0)

    def drop_prefix_cache(self) -> None:
        """Forget every cached block (idle ones become free); what sequences hold stays theirs."""
        pool = self.pool
        pool.free.extend(pool.idle)
        pool.idle.clear()
        pool.by_hash.clear()
        pool.hash_of.clear()

    def trim(self) -> None:
        """Release the storage when no sequence holds a block and none is cached (memory follows the tokens
        held)."""
        if self.pool.used == 0 and not self.pool.idle:
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
