"""The paged KV cache on its own: blocks follow the tokens held, forks share and copy on write."""

from __future__ import annotations

import pytest
import torch

from ead_llm.core.kv_cache import KVCache, OutOfBlocks, SequenceKV


def write_positions(cache: KVCache, seq: SequenceKV, values: list[float]) -> None:
    """Write one number per position (as a [T, 1, 1] key and value) after what ``seq`` holds."""
    start = seq.length
    cache.reserve(seq, start + len(values))
    table = torch.tensor([seq.blocks])
    positions = torch.arange(start, start + len(values))[None]
    slots = cache.slots(table, positions)[0]
    data = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
    for layer in range(cache.layers):
        cache.write(layer, slots, data + layer, data + layer)
    seq.length += len(values)


def read_positions(cache: KVCache, seq: SequenceKV, layer: int = 0) -> list[float]:
    slots = cache.slots(torch.tensor([seq.blocks]), torch.arange(seq.length)[None])
    keys, values = cache.gather(layer, slots)  # [1, 1, L, 1]
    assert torch.equal(keys, values)
    return keys.flatten().tolist()


def test_blocks_follow_the_tokens_held() -> None:
    cache = KVCache(2, block_size=4)
    a, b = SequenceKV(), SequenceKV()
    write_positions(cache, a, [1, 2, 3])
    write_positions(cache, b, list(range(10, 19)))  # 9 positions: 3 blocks
    assert len(a.blocks) == 1 and len(b.blocks) == 3 and cache.pool.used == 4
    write_positions(cache, a, [4, 5])  # crosses into a second block
    assert len(a.blocks) == 2 and read_positions(cache, a) == [1, 2, 3, 4, 5]
    assert read_positions(cache, b, layer=1) == [v + 1 for v in range(10, 19)]
    cache.truncate(b, 5)  # a rollback: positions 5.. are gone, and the third block with them
    assert b.length == 5 and len(b.blocks) == 2 and cache.pool.used == 4
    write_positions(cache, b, [99])
    assert read_positions(cache, b) == [10, 11, 12, 13, 14, 99]
    cache.free(a)
    cache.free(b)
    assert cache.pool.used == 0 and cache.tokens_held == 0
    assert cache.nbytes() > 0
    cache.trim()  # nothing held: the storage goes back
    assert cache.nbytes() == 0 and cache.peak_blocks == 5


def test_growth_keeps_what_was_written() -> None:
    cache = KVCache(1, block_size=2)
    seqs = [SequenceKV() for _ in range(20)]
    for i, seq in enumerate(seqs):  # 20 x 3 positions: 40 blocks, the pool doubles from 16 to 64
        write_positions(cache, seq, [i, i + 0.5, i + 0.25])
    assert cache.pool.num_blocks == 64
    assert [read_positions(cache, seq) for seq in seqs] == [[i, i + 0.5, i + 0.25] for i in range(20)]


def test_a_budget_bounds_the_blocks() -> None:
    cache = KVCache(1, block_size=4, max_tokens=10)  # 3 blocks
    a = SequenceKV()
    write_positions(cache, a, list(range(8)))
    assert cache.can_hold(1) and not cache.can_hold(2)
    b = SequenceKV()
    write_positions(cache, b, [1, 2])
    with pytest.raises(OutOfBlocks):
        cache.reserve(b, 5)
    assert len(b.blocks) == 1  # what it had stays
    cache.free(a)
    cache.reserve(b, 5)
    assert cache.nbytes() <= 3 * 4 * 4 * 2  # never more storage than the budget's blocks (float32 keys+values)


def test_forks_share_blocks_and_copy_the_one_they_write() -> None:
    cache = KVCache(1, block_size=4)
    parent = SequenceKV()
    write_positions(cache, parent, [1, 2, 3, 4, 5, 6])  # one full block, one partial
    child = cache.fork(parent)
    assert child.blocks == parent.blocks and cache.pool.used == 2  # nothing copied yet
    write_positions(cache, child, [70])
    write_positions(cache, parent, [60, 61])
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]  # the partial was copied
    assert read_positions(cache, parent) == [1, 2, 3, 4, 5, 6, 60, 61]
    assert read_positions(cache, child) == [1, 2, 3, 4, 5, 6, 70]
    cache.free(parent)
    assert read_positions(cache, child) == [1, 2, 3, 4, 5, 6, 70]  # the shared block lives on
    cache.free(child)
    assert cache.pool.used == 0


def test_a_rollback_into_a_shared_block_copies_it_first() -> None:
    cache = KVCache(1, block_size=4)
    parent = SequenceKV()
    write_positions(cache, parent, [1, 2, 3, 4, 5])
    child = cache.fork(parent)
    cache.truncate(child, 2)  # back inside the first, shared, block
    write_positions(cache, child, [9, 9])
    assert read_positions(cache, parent) == [1, 2, 3, 4, 5] and read_positions(cache, child) == [1, 2, 9, 9]
