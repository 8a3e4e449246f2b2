"""One model's paged KV cache: fixed-size blocks from a pool, a block table per sequence.

Memory follows the tokens held. Every layer stores keys and values head-major in one tensor
``[kv_heads, capacity_tokens, head_dim]``; a sequence owns a list of blocks of ``block_size`` positions (its block
table) and a length. Position ``p`` of a sequence lives at flat slot ``blocks[p // block_size] * block_size +
p % block_size``. The pool grows (by doubling, up to ``max_tokens``) when blocks run out or room must be kept after
a sequence (below), and is released when nothing is held.

Blocks are placed so that a sequence's blocks lie in order where room allows: its history is then, per head, one
contiguous run that the attention reads where it lies (measured on SmolLM2's shapes, a decode step's attention
over 4 rows of 1,100 positions: 20.6 ms head-major in place, 25.8 ms token-major in place, 59-67 ms copied
first; ``benchmarks/step_floor.py``).

A fork (an EAGER path branching off another) shares its parent's blocks; a block is copied only
when a sequence writes into a block that someone else also holds (copy on write). A rollback
(rejected speculative drafts) shortens the length and frees the blocks past it.

The scheduler asks for blocks (``reserve``) before a pass; the model runner writes the pass's new
keys and values (``write``) and reads each row's history inside the attention (``view`` in place, or
``gather``: a copy, for rows whose blocks are not in order or are short).

Prefix caching (the scheduler matches at admission and commits each step): a full block whose tokens are final
is registered (``commit``) under the hash chain of the tokens up to its end, so that another sequence
starting with the same tokens shares it (``match``) instead of computing it again. Only prompt positions are
committed: the model runner attends a prompt block by block (:class:`~ead_llm.core.model_runner.PromptAttention`),
so a cached block holds the bits a fresh pass over the same prompt computes, and a prompt reads the same bits with
or without a hit (an answer's positions, computed as decode steps, would not). A registered block that nobody holds
stays cached (idle, least recently used first) until a block is needed and none is free; a registered block is never
written again (a sequence that would write into it gets a private copy).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ead_llm.core.validation import check_int

DEFAULT_BLOCK_SIZE = 16
MIN_BLOCKS = 16
"""Blocks the pool starts with when it has no budget (it doubles from there)."""
MIN_CLAIM = 16
"""Blocks kept free after a sequence's last one for it, at least (up to what it may reach; more for a sequence
holding more: at most as many as it holds)."""


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
    expect: int = 0
    """Most blocks it may come to hold (room after its blocks is kept for them)."""
    claimed: range = range(0)
    """The free blocks after its last one kept for it (see :class:`BlockPool`)."""


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


HELD, FREE, CLAIMED = 0, 1, 2
"""A block's state in :attr:`BlockPool.state` (held and idle cached blocks are both HELD there)."""


class BlockPool:
    """Which blocks are free, how many sequences hold each one, and which full blocks are cached by the hash of
    their token chain (pure bookkeeping, no tensors).

    Blocks are placed so that a sequence's blocks lie in order where room allows (the model runner then
    attends over a view of them instead of copying them): a new sequence starts a run of free blocks long
    enough for all it may reach, and the free blocks after its last one are *claimed* for it. Others take a
    claimed block only when nothing else is left (then its owner's blocks stop being in order, which costs
    speed only). A claimed block is free: it counts as available."""

    def __init__(self, max_blocks: int | None) -> None:
        self.max_blocks = max_blocks
        self.num_blocks = 0
        self.refs: list[int] = []
        self.state = bytearray()
        """HELD, FREE or CLAIMED per block."""
        self._heap: list[int] = []
        """Free unclaimed blocks, lowest first (entries whose block was taken since are skipped)."""
        self.free_count = 0
        """Free blocks, claimed ones included."""
        self.claims: dict[int, object] = {}
        """Claimed block -> the sequence it is kept for."""
        self.by_hash: dict[int, int] = {}
        """Cached full blocks by the hash of their token chain."""
        self.hash_of: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()
        """Cached blocks nobody holds, least recently used first: taken back only when no block is free."""
        self.evictions = 0

    @property
    def used(self) -> int:
        """Blocks some sequence holds (idle cached blocks are not)."""
        return self.num_blocks - self.free_count - len(self.idle)

    def available(self) -> int | None:
        """Blocks that can still be handed out (None: no limit)."""
        if self.max_blocks is None:
            return None
        return self.free_count + len(self.idle) + self.max_blocks - self.num_blocks

    def can_grow(self) -> bool:
        return self.max_blocks is None or self.num_blocks < self.max_blocks

    def may_grow_for(self, want: int) -> bool:
        """Whether the pool may grow to keep ``want`` blocks in order: within the budget, and only while it holds
        less than twice what is held and wanted (idle cached blocks are reused before the pool grows past that,
        so the prefix cache cannot make it grow without end)."""
        return self.can_grow() and self.num_blocks < max(MIN_BLOCKS, 2 * (self.used + want))

    def allocate(self) -> int:
        """A block for one holder: a free unclaimed one, else the least recently used idle cached one
        (forgotten), else a claimed one (its owner's blocks stop being in order), else a new one."""
        block = self._pop_unclaimed()
        if block is None and self.idle:
            block, _ = self.idle.popitem(last=False)
            self.forget(block)
            self.evictions += 1
            self.refs[block] = 1
            return block
        if block is None and self.claims:
            block = next(iter(self.claims))
            del self.claims[block]
        if block is None:
            self._grow()
            block = self._pop_unclaimed()
            assert block is not None
        self._hold(block)
        return block

    def take(self, block: int, owner: object, want: int = 1) -> bool:
        """Hand ``owner`` this very block if it is free and not claimed by someone else (the block just past
        the pool grows it, as :meth:`may_grow_for` allows for the ``want`` blocks ``owner`` still expects);
        False otherwise."""
        if block == self.num_blocks and self.may_grow_for(want):
            self._grow()
        if block >= self.num_blocks or self.state[block] == HELD:
            return False
        if self.state[block] == CLAIMED:
            if self.claims[block] is not owner:
                return False
            del self.claims[block]
        self._hold(block)
        return True

    def place(self, want: int) -> int | None:
        """Where a sequence needing ``want`` blocks should start: the first run of that many free unclaimed
        blocks; else the free run at the end of the pool when the pool may grow past it; else the longest run
        (searched by halving); None when no block is free and unclaimed."""
        want = max(1, want)
        at = self.state.find(bytes([FREE]) * want)
        if at >= 0:
            return at
        if self.may_grow_for(want):
            return len(self.state.rstrip(bytes([FREE])))
        while want > 1:
            want //= 2
            at = self.state.find(bytes([FREE]) * want)
            if at >= 0:
                return at
        return None

    def claim(self, owner: object, blocks: range) -> range:
        """Keep the free unclaimed blocks of ``blocks`` for ``owner``, up to the first that is not (growing the
        pool, within its budget, for a run that reaches its end); returns those claimed."""
        if self.num_blocks < blocks.stop and not self.state[blocks.start :].strip(bytes([FREE])):
            while self.num_blocks < blocks.stop and self.may_grow_for(blocks.stop - self.num_blocks):
                self._grow()
        stop = blocks.start
        for block in blocks:
            if block >= self.num_blocks or self.state[block] != FREE:
                break
            self.state[block] = CLAIMED
            self.claims[block] = owner
            stop = block + 1
        return range(blocks.start, stop)

    def unclaim(self, owner: object, blocks: range) -> None:
        """Give back what ``owner`` still claims of ``blocks``."""
        for block in blocks:
            if self.claims.get(block) is owner:
                del self.claims[block]
                self.state[block] = FREE
                heapq.heappush(self._heap, block)

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
                self._free(block)

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

    def drop_idle(self) -> None:
        """Free every idle cached block (the cache itself is forgotten by the caller)."""
        for block in self.idle:
            self._free(block)
        self.idle.clear()

    def reset(self) -> None:
        self.num_blocks, self.refs, self.state, self._heap, self.free_count = 0, [], bytearray(), [], 0
        self.claims, self.by_hash, self.hash_of, self.idle = {}, {}, {}, OrderedDict()

    def _hold(self, block: int) -> None:
        self.state[block] = HELD
        self.free_count -= 1
        self.refs[block] = 1

    def _free(self, block: int) -> None:
        self.state[block] = FREE
        self.free_count += 1
        heapq.heappush(self._heap, block)

    def _pop_unclaimed(self) -> int | None:
        while self._heap:
            block = heapq.heappop(self._heap)
            if self.state[block] == FREE:
                return block
        return None

    def _grow(self) -> None:
        target = max(MIN_BLOCKS, 2 * self.num_blocks)
        if self.max_blocks is not None:
            target = min(target, self.max_blocks)
        if target <= self.num_blocks:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.refs.extend([0] * (target - self.num_blocks))
        self.state.extend(bytes([HELD]) * (target - self.num_blocks))
        for block in range(self.num_blocks, target):
            self._free(block)
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
        self.features: list[torch.Tensor | None] = [None]
        """``[1, capacity, hidden]``: each position's final hidden state, for a model whose draft reads it (else
        never written). Kept in the same blocks as the keys, so rollback, forks and the prefix cache cover it."""
        self.peak_blocks = 0
        """Most blocks held at once since the cache was made (what the memory had to cover)."""
        self.peak_nbytes = 0
        """Most bytes of storage allocated at once since the cache was made."""

    # -- bookkeeping (the scheduler) ---------------------------------------------------------------

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)  # ceil, in integers

    def can_hold(self, extra_blocks: int) -> bool:
        """Whether ``extra_blocks`` more blocks can be handed out now."""
        available = self.pool.available()
        return available is None or extra_blocks <= available

    def reserve(self, seq: SequenceKV, length: int, expect: int | None = None) -> None:
        """Give ``seq`` blocks for positions up to ``length``, and a private copy of any shared block
        it will write into; raises :class:`OutOfBlocks` (holding what it already had) when full.
        ``expect``: the most positions ``seq`` may reach, for which room after its blocks is kept."""
        if expect is not None:
            seq.expect = self.blocks_for(max(expect, length))
        if length <= seq.length:
            return
        blocks = seq.blocks
        first = seq.length // self.block_size
        if first < len(blocks) and self._shared(blocks[first]):
            private = self.pool.allocate()
            self._copy_block(blocks[first], private)
            self.pool.release(blocks[first])
            blocks[first] = private
        need = self.blocks_for(length)
        if len(blocks) < need:  # (most calls, a decode step inside its last block, end here)
            had = len(blocks)
            while len(blocks) < need:
                blocks.append(self._next_block(seq))
            self._clear(blocks[had:])
            self._claim(seq)
            self.peak_blocks = max(self.peak_blocks, self.pool.used)

    def _clear(self, blocks: list[int]) -> None:
        """Zero the keys and values of blocks just handed to a sequence. A row is read over a view padded past its
        end to its last block's end (masked); the numbers there must be finite whatever the block's last holder
        left (0 * NaN is NaN)."""
        size = self.block_size
        runs: list[list[int]] = []
        for block in blocks:
            if runs and block == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([block, 1])
        for tensors in (self.keys, self.values):
            for tensor in tensors:
                if tensor is not None:  # (storage grown later starts at zero)
                    for block, count in runs:
                        tensor[:, block * size : (block + count) * size].zero_()

    def _next_block(self, seq: SequenceKV) -> int:
        """The block after ``seq``'s last one when it is free for it, else the start of a run with room for all
        ``seq`` may reach (a sequence's first block), else any block."""
        pool = self.pool
        want = max(1, seq.expect - len(seq.blocks))
        if seq.blocks:
            if pool.take(seq.blocks[-1] + 1, seq, want):
                return seq.blocks[-1] + 1
        else:
            start = pool.place(want)
            if start is not None and pool.take(start, seq, want):
                return start
        return pool.allocate()

    def _claim(self, seq: SequenceKV) -> None:
        """Keep the free blocks after ``seq``'s last one for it, up to what it may reach."""
        self.pool.unclaim(seq, seq.claimed)
        if not seq.blocks or len(seq.blocks) >= seq.expect:
            seq.claimed = range(0)
            return
        after = seq.blocks[-1] + 1
        room = min(seq.expect - len(seq.blocks), max(MIN_CLAIM, len(seq.blocks)))
        seq.claimed = self.pool.claim(seq, range(after, after + room))

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
        if keep == len(seq.blocks):
            return
        for block in seq.blocks[keep:]:
            self.pool.release(block)
        del seq.blocks[keep:]
        if keep:
            self._claim(seq)  # the blocks it gave back stay its own to take again
        else:
            self.pool.unclaim(seq, seq.claimed)
            seq.claimed = range(0)

    def free(self, seq: SequenceKV) -> None:
        """Release all of ``seq``'s blocks."""
        self.truncate(seq, 0)

    def drop_prefix_cache(self) -> None:
        """Forget every cached block (idle ones become free); what sequences hold stays theirs."""
        pool = self.pool
        pool.drop_idle()
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
        self.features = [None]

    @property
    def tokens_held(self) -> int:
        return self.pool.used * self.block_size

    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *self.features)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # -- tensors (the model runner) ------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor | slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``[T, H, D]`` of one layer at flat ``slots`` ``[T]`` (or a range of them)."""
        stored_keys, stored_values = self.storage(layer, keys)
        stored_keys[:, slots] = keys.transpose(0, 1)
        stored_values[:, slots] = values.transpose(0, 1)

    def storage(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values ``[H, capacity, D]``, grown to hold every block of the pool first (new storage
        shaped like keys ``like`` ``[T, H, D]``), for a kernel that writes them itself."""
        capacity = self.pool.num_blocks * self.block_size
        stored = self.keys[layer]
        if stored is None or stored.shape[1] < capacity:
            self.keys[layer] = _fit(stored, capacity, like)
            self.values[layer] = _fit(self.values[layer], capacity, like)
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes())
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None
        return keys, values

    def write_features(self, slots: torch.Tensor, features: torch.Tensor) -> None:
        """Store final hidden states ``[T, hidden]`` at flat ``slots`` ``[T]``."""
        capacity = self.pool.num_blocks * self.block_size
        stored = self.features[0]
        if stored is None or stored.shape[1] < capacity:
            self.features[0] = stored = _fit(stored, capacity, features[:, None])
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes())
        stored[0, slots] = features

    def read_features(self, slots: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[N, hidden]`` at flat ``slots`` ``[N]`` (a copy)."""
        stored = self.features[0]
        assert stored is not None, "features read before any were written"
        return stored[0].index_select(0, slots)

    def sequence_features(self, seq: SequenceKV, length: int) -> torch.Tensor:
        """Final hidden states of the first ``length`` positions of ``seq`` ``[length, hidden]`` (a copy)."""
        stored = self.features[0]
        assert stored is not None, "features read before any were written"
        blocks = torch.tensor(seq.blocks[: self.blocks_for(length)], dtype=torch.long, device=stored.device)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=stored.device)).flatten()
        return stored[0].index_select(0, slots[:length])

    def gather(
        self, layer: int, slots: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, L, D]`` of one layer at flat ``slots`` ``[B, L]`` (a copy; into the storage of
        ``into``, an earlier gather's result of the same shape, when given)."""
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None, "gather before any write"
        batch, length = slots.shape
        flat = slots.reshape(-1)
        heads, _, dim = keys.shape
        out = []
        for tensor, buffer in zip((keys, values), into or (None, None), strict=True):
            if buffer is None:
                picked = tensor.index_select(1, flat)
            else:
                picked = torch.index_select(
                    tensor, 1, flat, out=buffer.transpose(0, 1).view(heads, batch * length, dim)
                )
            out.append(picked.view(heads, batch, length, dim).transpose(0, 1))
        return out[0], out[1]

    def slots(self, blocks: Sequence[int], positions: Iterable[int]) -> list[int]:
        """The flat slots of ``positions`` of a sequence with this block table."""
        size = self.block_size
        return [blocks[p // size] * size + p % size for p in positions]

    def move(self, seq: SequenceKV, source: int, target: int) -> None:
        """Copy what position ``source`` of ``seq`` holds (every layer's keys and values, and its features) to
        position ``target`` (a block ``seq`` wrote this step: its own)."""
        slots = self.slots(seq.blocks, (source, target))
        for tensors in (self.keys, self.values, self.features):
            for tensor in tensors:
                if tensor is not None:
                    tensor[:, slots[1]] = tensor[:, slots[0]]

    def view(self, layer: int, span: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, H, L, D]`` of one layer at the consecutive flat slots ``span`` (no copy; each
        head's positions lie together)."""
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None, "view before any write"
        return keys[:, span][None], values[:, span][None]

    def _copy_block(self, source: int, target: int) -> None:
        size = self.block_size
        for tensors in (self.keys, self.values, self.features):
            for layer, tensor in enumerate(tensors):
                if tensor is None:
                    continue
                tensors[layer] = tensor = _fit(tensor, self.pool.num_blocks * size, tensor.transpose(0, 1))
                tensor[:, target * size : (target + 1) * size] = tensor[:, source * size : (source + 1) * size]


def _fit(storage: torch.Tensor | None, capacity: int, like: torch.Tensor) -> torch.Tensor:
    """``storage`` ``[H, slots, D]`` grown to ``capacity`` slots (its contents kept), or a new one for tokens shaped
    like ``like`` ``[T, H, D]``."""
    if storage is not None and storage.shape[1] >= capacity:
        return storage
    heads, dim = like.shape[1], like.shape[2]
    grown = torch.empty((heads, capacity, dim), dtype=like.dtype, device=like.device)
    kept = 0 if storage is None else storage.shape[1]
    if storage is not None:
        grown[:, :kept] = storage
    grown[:, kept:].zero_()  # slots never written read as 0 (see KVCache._clear)
    return grown
