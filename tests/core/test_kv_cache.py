"""The paged KV cache on its own: blocks follow the tokens held, forks share and copy on write."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ead_llm.core.kv_cache import KVCache, OutOfBlocks, SequenceKV, block_hashes


def slots_of(cache: KVCache, seq: SequenceKV, positions: range) -> torch.Tensor:
    """The flat slots of ``positions`` of ``seq``, by the cache's documented layout."""
    size = cache.block_size
    return torch.tensor([seq.blocks[p // size] * size + p % size for p in positions], dtype=torch.long)


def write_positions(cache: KVCache, seq: SequenceKV, values: list[float]) -> None:
    """Write one number per position (as a [T, 1, 1] key and value) after what ``seq`` holds."""
    start = seq.length
    cache.reserve(seq, start + len(values))
    slots = slots_of(cache, seq, range(start, start + len(values)))
    data = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
    for layer in range(cache.layers):
        cache.write(layer, slots, data + layer, data + layer)
    seq.length += len(values)


def read_positions(cache: KVCache, seq: SequenceKV, layer: int = 0) -> list[float]:
    slots = slots_of(cache, seq, range(seq.length))[None]
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


# -- prefix caching (bookkeeping) ---------------------------------------------------------------------------------


def test_a_block_hash_covers_every_token_before_it() -> None:
    a, b = block_hashes(list(range(8)), 4), block_hashes([9, *range(1, 8)], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # the same second block after another first one
    assert block_hashes(list(range(7)), 4) == a[:1]  # a partial block has no hash
    assert block_hashes(list(range(8)), 4) == a  # the same tokens, the same chain


def committed(cache: KVCache, tokens: list[int]) -> SequenceKV:
    """A sequence that wrote ``tokens`` (each as its own number) and committed them to the prefix cache."""
    seq = SequenceKV()
    write_positions(cache, seq, [float(t) for t in tokens])
    cache.commit(seq, tokens)
    return seq


def test_a_committed_prefix_is_shared_not_recomputed() -> None:
    cache = KVCache(1, block_size=4)
    tokens = list(range(10))
    first = committed(cache, tokens)
    second = SequenceKV()
    assert cache.match(second, [*tokens[:9], 99]) == 8  # two full blocks of the 9 shared tokens
    assert second.blocks == first.blocks[:2] and cache.pool.refs[first.blocks[0]] == 2
    write_positions(cache, second, [8.0, 99.0])  # only the positions past the shared blocks are computed
    assert read_positions(cache, second) == [*map(float, range(9)), 99.0]
    assert read_positions(cache, first) == [*map(float, range(10))]  # the first sequence's view is unchanged
    assert cache.match(SequenceKV(), tokens[:8]) == 4  # the last token is always computed (its logits are needed)
    with pytest.raises(ValueError, match="before it holds"):
        cache.match(second, tokens)


def test_cached_blocks_outlive_their_holders_until_blocks_run_out() -> None:
    cache = KVCache(1, block_size=4, max_tokens=16)  # 4 blocks
    tokens = list(range(9))
    cache.free(committed(cache, tokens))
    assert cache.pool.used == 0 and len(cache.pool.idle) == 2 and cache.pool.available() == 4
    cache.trim()
    assert cache.nbytes() > 0  # the cache keeps its storage while blocks are cached
    again = SequenceKV()
    assert cache.match(again, tokens) == 8 and len(cache.pool.idle) == 0
    assert read_positions(cache, again) == [float(t) for t in range(8)]
    cache.free(again)
    other = SequenceKV()
    write_positions(cache, other, [1.0] * 16)  # needs all 4 blocks: the 2 free ones, then the 2 cached (oldest first)
    assert cache.pool.evictions == 2 and not cache.pool.by_hash and cache.match(SequenceKV(), tokens) == 0


def test_a_cached_block_is_never_written_again() -> None:
    cache = KVCache(1, block_size=4)
    tokens = list(range(8))
    seq = committed(cache, tokens)
    cached = seq.blocks[1]
    cache.truncate(seq, 6)  # a rejected draft: roll back into the cached block...
    write_positions(cache, seq, [-1.0, -2.0])  # ...and write other tokens there
    assert seq.blocks[1] != cached and read_positions(cache, seq) == [0, 1, 2, 3, 4, 5, -1, -2]
    reader = SequenceKV()
    assert cache.match(reader, [*tokens, 50]) == 8 and read_positions(cache, reader) == [float(t) for t in tokens]


def test_only_final_tokens_are_committed() -> None:
    cache = KVCache(1, block_size=4)
    seq = SequenceKV()
    write_positions(cache, seq, [0.0] * 8)
    cache.commit(seq, [0, 0, 0, 0, 0])  # drafts past the fifth token may still be rejected
    assert len(cache.pool.by_hash) == 1


# -- blocks in order (the runner's views) -------------------------------------------------------------------------


def test_sequences_growing_side_by_side_keep_their_blocks_in_order() -> None:
    """Room is kept after each sequence's blocks for what it may reach, so sequences admitted together and
    growing in turn each hold consecutive blocks (the runner attends over a view of them, copying nothing)."""
    cache = KVCache(1, block_size=4)
    seqs = [SequenceKV() for _ in range(4)]
    for seq in seqs:
        cache.reserve(seq, 10, expect=40)  # 3 blocks now, 10 at most
    for length in range(11, 41):
        for seq in seqs:
            cache.reserve(seq, length, expect=40)
    for seq in seqs:
        assert seq.blocks == list(range(seq.blocks[0], seq.blocks[0] + 10))
    assert len({block for seq in seqs for block in seq.blocks}) == 40


def test_room_kept_for_a_sequence_is_lent_only_when_nothing_else_is_left() -> None:
    cache = KVCache(1, block_size=1, max_tokens=8)
    owner, other = SequenceKV(), SequenceKV()
    cache.reserve(owner, 2, expect=6)  # blocks 0 and 1; 2..5 kept for it
    assert owner.blocks == [0, 1] and cache.pool.available() == 6  # kept blocks are still available
    cache.reserve(other, 2, expect=2)
    assert other.blocks == [6, 7]  # not the kept ones
    cache.reserve(other, 3)  # nothing else is left: a kept block is lent
    assert other.blocks[-1] in range(2, 6)
    cache.reserve(owner, 5)  # the owner still gets its blocks, no longer all in order
    assert len(owner.blocks) == 5 and cache.pool.available() == 0
    with pytest.raises(OutOfBlocks):
        cache.reserve(other, 4)


def test_a_rollback_keeps_the_blocks_it_gives_back_for_the_sequence() -> None:
    cache = KVCache(1, block_size=1)
    seq, other = SequenceKV(), SequenceKV()
    write_positions(cache, seq, list(range(8)))
    cache.reserve(seq, 8, expect=12)
    cache.truncate(seq, 3)  # rejected drafts
    cache.reserve(other, 4, expect=4)
    assert not set(other.blocks) & set(range(seq.blocks[0], seq.blocks[0] + 12))
    write_positions(cache, seq, [7.0] * 9)
    assert seq.blocks == list(range(seq.blocks[0], seq.blocks[0] + 12))
    assert read_positions(cache, seq) == [0, 1, 2] + [7.0] * 9
    cache.free(seq)
    cache.free(other)
    pool = cache.pool
    assert pool.used == 0 and not pool.claims and pool.free_count == pool.num_blocks


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["grow", "rollback", "fork", "free", "commit", "match"]),
            st.integers(0, 3),
            st.integers(1, 9),
        ),
        max_size=40,
    ),
    budget=st.sampled_from([None, 24, 40]),
)
def test_any_mix_of_operations_keeps_the_books_and_the_data(
    ops: list[tuple[str, int, int]], budget: int | None
) -> None:
    """Fuzzed growth, rollbacks, forks, frees and prefix caching under a budget: every sequence reads back what it
    wrote, and the pool's books agree with who holds what (no block both free and held, claims only on free
    blocks, the budget never exceeded)."""
    cache = KVCache(1, block_size=2, max_tokens=budget)
    seqs: list[tuple[SequenceKV, list[float]]] = []
    counter = 0.0
    for op, index, amount in ops:
        if op != "match" and not seqs:
            op = "match"
        held = seqs[index % len(seqs)] if seqs else None
        try:
            if op == "grow" and held is not None:
                seq, values = held
                new = [counter + i for i in range(amount)]
                counter += amount
                cache.reserve(seq, seq.length + amount, expect=seq.length + 3 * amount)
                write_positions(cache, seq, new)
                values.extend(new)
            elif op == "rollback" and held is not None:
                seq, values = held
                cache.truncate(seq, max(0, seq.length - amount))
                del values[seq.length :]
            elif op == "fork" and held is not None and len(seqs) < 6:
                seqs.append((cache.fork(held[0]), list(held[1])))
            elif op == "free" and held is not None:
                cache.free(held[0])
                seqs.remove(held)
            elif op == "commit" and held is not None:
                cache.commit(held[0], [int(v) for v in held[1]])
            elif op == "match" and len(seqs) < 6:
                seq = SequenceKV()
                tokens = [float(v) for v in range(amount * 2)]
                cache.match(seq, [int(v) for v in tokens])
                seqs.append((seq, tokens[: seq.length]))
        except OutOfBlocks:
            pass
        for seq, values in seqs:
            assert read_positions(cache, seq) == values if seq.length else True
        pool = cache.pool
        holders: dict[int, int] = {}
        for seq, _ in seqs:
            assert len(set(seq.blocks)) == len(seq.blocks)
            for block in seq.blocks:
                holders[block] = holders.get(block, 0) + 1
        for block in range(pool.num_blocks):
            assert pool.refs[block] == holders.get(block, 0)
            free = pool.state[block] != 0
            assert free == (block not in holders and block not in pool.idle)
            assert (pool.state[block] == 2) == (block in pool.claims)
        assert pool.free_count == sum(1 for state in pool.state if state != 0)
        assert pool.used == len(holders)
        assert budget is None or pool.num_blocks <= -(-budget // 2)


def test_room_for_sequences_never_makes_the_pool_outgrow_the_cache() -> None:
    """Keeping blocks in order may grow the pool only up to twice what is held and wanted: past that, idle cached
    blocks are reused, so fifty different prompts one after another (each cached, then idle) leave it bounded."""
    cache = KVCache(1, block_size=2)
    for i in range(50):
        seq = SequenceKV()
        tokens = [i * 100 + t for t in range(20)]
        cache.reserve(seq, 20, expect=40)
        seq.length = 20
        cache.commit(seq, tokens)
        cache.free(seq)
    assert cache.pool.num_blocks <= 64 and cache.pool.evictions > 0
