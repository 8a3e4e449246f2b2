"""The batched sampler: counter-based uniforms, greedy rows, exact temperature / top-k / top-p draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ead_llm.core.ops import filter_logits, filtered_probs, top_two
from ead_llm.core.sampler import (
    CHUNK,
    LANE_ACCEPT,
    LANE_SAMPLE,
    Sampler,
    SamplingMetadata,
    fork_key,
    inverse_cdf,
    sample,
    stream_key,
    uniforms,
)
from tests.reference import reference_probs, rounding_edge


def draw_many(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, n: int) -> torch.Tensor:
    """``n`` draws of one row, one per position (so each uses fresh uniforms)."""
    rows = logits[None].expand(n, -1)
    meta = SamplingMetadata.build([(temperature, top_k, top_p, 1234, position) for position in range(n)])
    return sample(rows, meta)


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.shape[-1]).double()
    return 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())


def test_uniforms_are_fixed_by_key_position_and_lane() -> None:
    keys = torch.tensor([1, 2, 1, -5], dtype=torch.int64)
    positions = torch.tensor([7, 7, 8, 7], dtype=torch.int64)
    u = uniforms(keys, positions, LANE_SAMPLE, 3)  # [4, 3]
    assert u.shape == (4, 3) and u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, uniforms(keys, positions, LANE_SAMPLE, 3))  # the same numbers again
    alone = uniforms(keys[2:3], positions[2:3], LANE_SAMPLE, 3)
    assert torch.equal(alone, u[2:3])  # a row's numbers do not depend on the batch
    assert len({round(x, 12) for x in u.flatten().tolist()}) == 12  # all different
    assert not torch.equal(uniforms(keys, positions, LANE_ACCEPT, 3), u)
    many = uniforms(torch.arange(20000), torch.zeros(20000, dtype=torch.int64), LANE_SAMPLE, 1)[:, 0]
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005
    assert stream_key(3, 1) == stream_key(3, 1) != stream_key(3, 2) and stream_key(None, 0) != stream_key(None, 0)
    assert fork_key(stream_key(3, 1), 10) != fork_key(stream_key(3, 1), 11)


def test_greedy_rows_are_the_argmax_and_rows_are_independent() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 3
    rows = [(0.0, 0, 1.0, 1, 3), (0.9, 0, 1.0, 2, 3), (0.0, 5, 0.5, 3, 3), (1.3, 7, 0.8, 4, 9), (0.7, 0, 0.9, 5, 2)]
    out = Sampler()(logits, SamplingMetadata.build(rows))
    assert out.tokens[0] == logits[0].argmax() and out.tokens[2] == logits[2].argmax()
    for b in range(5):  # each row alone gives the same token
        alone = Sampler()(logits[b : b + 1], SamplingMetadata.build([rows[b]]))
        assert int(alone.tokens[0]) == int(out.tokens[b])
    expected = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1) / math.log(2)
    assert torch.allclose(out.entropy_bits, expected, atol=1e-5)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (1.0, 0, 0.3), (1.4, 12, 0.75), (0.8, 3, 0.2)],
)
def test_draws_follow_the_filtered_distribution(temperature: float, top_k: int, top_p: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(30) * 1.5
    probs = reference_probs(logits, temperature, top_k, top_p)
    tokens = draw_many(logits, temperature, top_k, top_p, 20000)
    assert bool((probs[tokens] > 0).all())  # never a token outside the top-k or the nucleus
    # with 20000 draws the total variation to the true distribution is about 0.01; 0.03 would be a bias
    assert total_variation(tokens, probs) < 0.03
    assert torch.allclose(
        filtered_probs(
            logits[None],
            torch.tensor([temperature]),
            torch.tensor([top_k]),
            torch.tensor([top_p]),
            max_top_k=top_k,
            any_top_p=top_p < 1.0,
        )[0],
        probs,
        atol=1e-6,
    )


def test_a_flat_distribution_with_a_small_nucleus_draws_only_inside_it() -> None:
    logits = torch.zeros(400)  # nearly uniform: top-p 0.05 keeps the 20 slightly more likely tokens
    logits[:20] = 0.01
    tokens = draw_many(logits, 1.0, 0, 0.05, 3000)
    assert set(tokens.tolist()) == set(range(20))
    assert total_variation(tokens, reference_probs(logits, 1.0, 0, 0.05)) < 0.06


TIES = [
    # (logits, top_k, top_p, the tokens that must be drawable)
    ([2.0, 1.0, 1.0, 1.0, 0.0, -1.0], 2, 1.0, {0, 1, 2, 3}),  # top-2 cuts inside a three-way tie: all kept
    ([1.0, 1.0, 1.0, 0.0, 0.0, -1.0], 1, 1.0, {0, 1, 2}),
    ([2.0, 1.0, 1.0, 1.0, 0.0, -1.0], 0, 0.5, {0, 1, 2, 3}),  # the nucleus edge falls inside the tie
    ([2.0, 1.0, 1.0, 1.0, 0.0, -1.0], 0, 0.3, {0}),  # ... or before it
    ([1.0, 1.0, 1.0, 1.0, 0.0, 0.0], 3, 0.4, {0, 1, 2, 3}),  # both cuts inside one tie
]


@pytest.mark.parametrize(("values", "top_k", "top_p", "support"), TIES)
def test_ties_at_a_cut_are_kept_and_drawn_as_often_as_their_equals(
    values: list[float], top_k: int, top_p: float, support: set[int]
) -> None:
    logits = torch.tensor(values)
    probs = reference_probs(logits, 1.0, top_k, top_p)
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == support  # the reference applies the rule
    kept = filtered_probs(
        logits[None], torch.ones(1), torch.tensor([top_k]), torch.tensor([top_p]), max_top_k=top_k, any_top_p=True
    )[0]
    assert torch.allclose(kept, probs, atol=1e-6)
    for perm in (torch.arange(6).flip(0), torch.tensor([3, 0, 5, 1, 4, 2])):  # the order of the vocabulary
        moved = filtered_probs(
            logits[perm][None],
            torch.ones(1),
            torch.tensor([top_k]),
            torch.tensor([top_p]),
            max_top_k=top_k,
            any_top_p=True,
        )[0]
        assert torch.allclose(moved, probs[perm], atol=1e-6)
    tokens = draw_many(logits, 1.0, top_k, top_p, 8000)
    assert set(tokens.tolist()) == support
    assert total_variation(tokens, probs) < 0.03


def test_the_top_two_tokens_break_ties_by_the_lower_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [5.0, 1.0, 5.0, 0.0, 0.0], [1.0, 2.0, 0.0, 0.0, 0.0]])
    first, second = top_two(logits)
    assert first.tolist() == [1, 0, 1] and second.tolist() == [3, 2, 0]
    greedy = sample(logits, SamplingMetadata.build([(0.0, 0, 1.0, 0, 0)] * 3))
    assert torch.equal(greedy, first)


def test_a_seed_gives_the_same_draws_on_any_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, 50)
    rows = [(1.0, 0, 0.9, stream_key(7, b), 11) for b in range(8)]
    together = sample(logits, SamplingMetadata.build(rows))
    reversed_rows = sample(logits.flip(0), SamplingMetadata.build(rows[::-1])).flip(0)
    assert torch.equal(together, reversed_rows)


def test_draws_over_a_large_vocabulary_find_the_chunk_then_the_token() -> None:
    vocab = 5 * CHUNK + 123  # several chunks and a partial one
    gen = torch.Generator().manual_seed(4)
    weights = torch.rand(1, vocab, generator=gen) ** 8  # uneven
    weights[0, 3 * CHUNK : 4 * CHUNK] = 0.0  # a whole chunk that must never be drawn
    weights[0, -1] = 5.0  # heavy mass in the partial chunk at the end
    n = 40000
    u = uniforms(torch.full((n,), 3, dtype=torch.int64), torch.arange(n), LANE_SAMPLE, 1)
    tokens = inverse_cdf(weights.expand(n, -1), u)[:, 0]
    assert bool((weights[0, tokens] > 0).all())
    probs = (weights[0] / weights[0].sum()).double()
    counts = torch.bincount(tokens, minlength=vocab).double() / n
    assert abs(float(counts[-1]) - float(probs[-1])) < 0.01
    by_chunk = lambda x: torch.stack([x[i : i + CHUNK].sum() for i in range(0, vocab, CHUNK)])  # noqa: E731
    assert float((by_chunk(counts) - by_chunk(probs)).abs().max()) < 0.01
    # the edges: u = 0 gives the first positive weight, u close to 1 the last
    edges = inverse_cdf(weights, torch.tensor([[0.0, 1.0 - 1e-16]], dtype=torch.float64))[0].tolist()
    assert edges == [int((weights[0] > 0).nonzero()[0]), vocab - 1]


FILTER_ROWS = {
    "seed": st.integers(0, 10_000),
    "vocab": st.sampled_from([7, 80, 3000]),
    "spread": st.sampled_from([0.05, 1.0, 6.0]),
    "step": st.sampled_from([0.0, 0.25]),
    "top_k": st.integers(0, 90),
    "top_p": st.sampled_from([1.0, 0.999, 0.95, 0.6, 0.2]),
}
"""Rows for the filter's tests: flat, spread or rounded (ties) logits, any top-k, top-p from off to tight."""


@settings(max_examples=60, deadline=None)
@example(seed=1, vocab=3000, spread=0.05, step=0.0, top_k=0, top_p=0.2)  # a nucleus of ~600: the whole row
@example(seed=2, vocab=3000, spread=0.05, step=0.0, top_k=0, top_p=0.95)  # ~2,800: the whole row
@example(seed=3, vocab=3000, spread=1.0, step=0.25, top_k=0, top_p=0.6)  # ties at the edge, deep
@example(seed=4, vocab=80, spread=6.0, step=0.25, top_k=5, top_p=0.999)  # top-k cut in a tie, then top-p
@example(seed=500, vocab=3000, spread=6.0, step=0.0, top_k=0, top_p=0.999)  # an edge 6e-8 from the threshold
@given(**FILTER_ROWS)
def test_the_floor_keeps_what_the_plain_rule_keeps(
    seed: int, vocab: int, spread: float, step: float, top_k: int, top_p: float
) -> None:
    """Flat rows (nuclei past the 64 candidates, of ~600 to ~2,800 tokens), rounded rows (ties everywhere), masked
    tokens: the fast floor keeps exactly the plain reference's tokens, but for a token whose mass before it lies
    within rounding (1e-5 of the row's mass) of the threshold, which the native nucleus's float32 sums and its own
    ``exp`` may decide the other way (found by this test: seed 500, 6e-8 from it); and a row alone gets the floor
    it gets in a batch."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=gen) * spread
    if step:
        logits = torch.round(logits / step) * step  # bf16-like: many equal values
    logits[1, : vocab // 3] = -math.inf  # a grammar's mask
    temperature, k, p = torch.full((3,), 0.9), torch.full((3,), top_k), torch.full((3,), top_p)
    kept = filter_logits(logits, temperature, k, p, max_top_k=top_k, any_top_p=top_p < 1) > -math.inf
    for b in range(3):
        expected = reference_probs(logits[b], 0.9, top_k, top_p) > 0
        differ = kept[b] != expected
        if differ.any():  # the edge's own pass over the row, only for a row that differs
            differ &= ~rounding_edge(logits[b], 0.9, top_k, top_p)
        assert not differ.any(), (b, int(kept[b].sum()), int(expected.sum()))
        alone = filter_logits(logits[b : b + 1], temperature[:1], k[:1], p[:1], max_top_k=top_k, any_top_p=top_p < 1)
        assert torch.equal(alone[0] > -math.inf, kept[b])


@settings(max_examples=40, deadline=None)
@example(seed=2, vocab=3000, spread=0.05, step=0.0, top_k=0, top_p=0.95)  # the CPU searches the whole row
@example(seed=3, vocab=3000, spread=1.0, step=0.25, top_k=0, top_p=0.6)  # ties at the edge
@example(seed=4, vocab=80, spread=6.0, step=0.25, top_k=5, top_p=0.999)  # top-k cut in a tie, then top-p
@example(seed=5, vocab=3000, spread=6.0, step=0.0, top_k=40, top_p=1.0)  # top-k alone
@given(**FILTER_ROWS)
def test_sorting_every_row_whole_keeps_and_draws_what_the_search_does(
    seed: int, vocab: int, spread: float, step: float, top_k: int, top_p: float
) -> None:
    """The GPU's filter (every row sorted whole, every sampled row drawn over the vocabulary: no step that looks at
    the data, so no host sync) keeps the tokens the CPU's candidate search keeps, and the same seed draws the same
    tokens."""
    from unittest import mock

    from ead_llm.core import ops

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=gen) * spread
    if step:
        logits = torch.round(logits / step) * step
    logits[1, : vocab // 3] = -math.inf
    row_p = [top_p, top_p, top_p, 1.0]  # the last row: top-k alone, beside rows with top-p
    temperature, k, p = torch.full((4,), 0.9), torch.full((4,), top_k), torch.tensor(row_p)
    meta = SamplingMetadata.build([(0.9, top_k, row_p[b], stream_key(seed, b), 7) for b in range(4)])

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        kept = filter_logits(logits, temperature, k, p, max_top_k=top_k, any_top_p=top_p < 1) > -math.inf
        return kept, sample(logits, meta)

    searched = both()
    assert not ops.sorts_whole_rows(logits)
    with mock.patch.object(ops, "SORT_WHOLE_ROWS", frozenset({"cpu"})):
        assert ops.sorts_whole_rows(logits)
        whole = both()
    assert torch.equal(whole[0], searched[0])
    assert torch.equal(whole[1], searched[1])


@pytest.mark.parametrize("top_p", [0.95, 0.2], ids=["most-of-the-row", "a-nucleus-of-600"])
def test_a_nucleus_past_the_candidates_is_searched_over_the_whole_row_and_never_sorted(
    top_p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flat row's nucleus of ~2,800 (or ~600) of 3,000 tokens lies past its 64 candidates: the whole row is
    searched at once, with no wider look first and no sort. The kept set is the plain rule's. (torch's search, as
    where the kernel does not run; the kernel's floor is tested equal to it.)"""
    from ead_llm.core import ops

    monkeypatch.setattr(ops, "on_kernel", lambda logits: False)
    logits = torch.randn(1, 3000, generator=torch.Generator().manual_seed(1)) * 0.05
    looks, searches, topk, search = [], [], torch.topk, ops.nucleus_by_digits
    monkeypatch.setattr(torch, "topk", lambda x, k, *a, **kw: looks.append(k) or topk(x, k, *a, **kw))
    monkeypatch.setattr(ops, "nucleus_by_digits", lambda given, *a: searches.append(given.shape) or search(given, *a))
    monkeypatch.setattr(ops, "sorted_descending", lambda rows: pytest.fail("a row was sorted"))
    kept = filter_logits(
        logits,
        torch.full((1,), 0.9),
        torch.zeros(1, dtype=torch.long),
        torch.full((1,), top_p),
        max_top_k=0,
        any_top_p=True,
    )
    assert looks == [ops.CANDIDATES] and searches == [(1, 3000)]
    assert torch.equal(kept[0] > -math.inf, reference_probs(logits[0], 0.9, 0, top_p) > 0)


def test_rows_drawn_over_the_vocabulary_take_their_own_weights_in_a_mixed_batch() -> None:
    """Flat rows (drawn over the whole vocabulary, from the weights the filter already computed) between peaked
    rows whose nucleus lies among their candidates and a top-k row: each row draws in the batch what it draws
    alone, and only tokens the plain rule keeps."""
    gen = torch.Generator().manual_seed(11)
    vocab = 4000
    logits = torch.randn(5, vocab, generator=gen)
    logits[[0, 2, 4]] *= 0.01  # flat: the nucleus reaches far past the candidates
    logits[1, 17] = 30.0  # peaked: one token holds the mass
    settings_ = [(0.9, 0, 0.9), (0.9, 0, 0.9), (0.9, 0, 0.5), (0.9, 50, 0.95), (0.9, 0, 0.99)]
    allowed = [reference_probs(logits[b], t, k, p) > 0 for b, (t, k, p) in enumerate(settings_)]  # the same rows
    for position in range(20):
        rows = [(t, k, p, stream_key(3, b), position) for b, (t, k, p) in enumerate(settings_)]
        together = sample(logits, SamplingMetadata.build(rows))
        for b in range(len(settings_)):
            alone = sample(logits[b : b + 1], SamplingMetadata.build(rows[b : b + 1]))
            assert int(alone) == int(together[b]), (position, b)
            assert allowed[b][int(alone)]


@pytest.mark.parametrize("block_rows", [1, 2, 3])
def test_rows_sampled_in_blocks_give_what_one_block_gives(block_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass's rows drawn in blocks that fit the cache (greedy rows between sampled ones, flat and peaked rows,
    every filter) give the tokens and entropies the whole batch gives in one block."""
    from ead_llm.core import sampler as module

    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.randn(7, vocab, generator=gen) * torch.tensor([0.01, 3.0, 0.01, 1.0, 0.01, 5.0, 0.5])[:, None]
    settings_ = [
        (0.9, 0, 0.9),
        (0.0, 0, 1.0),
        (1.0, 40, 0.95),
        (0.7, 0, 1.0),
        (0.0, 0, 1.0),
        (1.2, 0, 0.5),
        (1.0, 5, 1.0),
    ]
    every_row_samples = [(t or 0.8, k, p) for t, k, p in settings_]
    for position, rows in enumerate([settings_, every_row_samples] * 3):
        meta = SamplingMetadata.build([(t, k, p, stream_key(9, b), position) for b, (t, k, p) in enumerate(rows)])
        whole = Sampler()(logits, meta)
        monkeypatch.setattr(module, "BLOCK_BYTES", 4 * vocab * block_rows)
        assert len(module.row_blocks(len(logits), vocab, logits.device)) == -(-len(logits) // block_rows)
        blocked = Sampler()(logits, meta)
        monkeypatch.undo()
        assert torch.equal(whole.tokens, blocked.tokens) and torch.equal(whole.entropy_bits, blocked.entropy_bits)


def test_a_top_k_cut_inside_a_wide_tie_then_top_p_is_searched_over_what_top_k_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Top-k 10 on a row whose 10th value ties with 1,500 others keeps all 1,500 (ties at the cut are kept); top-p
    0.9 over them reaches past every candidate, so the whole row is searched, with the tokens below the top-k cut
    already dropped; the kept set is the plain rule's, and a draw lands in it. (A top-k row takes torch's search
    wherever the kernel runs.)"""
    from ead_llm.core import ops

    logits = torch.zeros(1, 3000)
    logits[0, 1::2] = -0.25  # half the row ties at the top, half just below
    searches, search = [], ops.nucleus_by_digits
    monkeypatch.setattr(ops, "nucleus_by_digits", lambda given, *a: searches.append(given) or search(given, *a))
    args = (torch.full((1,), 0.9), torch.full((1,), 10), torch.full((1,), 0.9))
    kept = filter_logits(logits, *args, max_top_k=10, any_top_p=True)[0] > -math.inf
    assert len(searches) == 1 and int(torch.isinf(searches[0]).sum()) == 1500  # searched over top-k's 1,500
    assert torch.equal(kept, reference_probs(logits[0], 0.9, 10, 0.9) > 0) and int(kept.sum()) == 1500
    drawn = sample(logits, SamplingMetadata.build([(0.9, 10, 0.9, stream_key(1, 0), 3)]))
    assert bool(kept[int(drawn)])


def test_temperature_only_rows_are_drawn_by_the_kernel_alone_or_beside_top_k_rows() -> None:
    """A row without top-k or top-p takes the kernel's draw over every token (top-p 1) where the kernel runs: the
    token its inverse CDF gives for the row's uniform, the same alone, among rows like it (one kernel call), and
    beside top-k rows (which keep torch's candidate path). Torch's inverse CDF over ``exp`` draws the same tokens
    here but for rounding at a boundary, so the test counts the kernel's calls."""
    from ead_llm.core import kernels, ops

    if not kernels.available():
        pytest.skip("no kernel here: torch draws every row")
    logits = torch.randn(6, 20000, generator=torch.Generator().manual_seed(3)) * 0.5  # flat: the draw spreads
    rows = [(0.9, 0 if b % 3 else 40, 1.0, stream_key(5, b), 7 + b) for b in range(6)]  # rows 0 and 3: top-k 40
    together = sample(logits, SamplingMetadata.build(rows))
    plain = [b for b in range(6) if b % 3]
    calls = []
    nucleus = kernels.nucleus
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "nucleus", lambda *args: calls.append(len(args[0])) or nucleus(*args))
        only = sample(logits[plain], SamplingMetadata.build([rows[b] for b in plain]))
    assert calls == [len(plain)] and torch.equal(only, together[plain])
    for b in range(6):
        assert int(sample(logits[b : b + 1], SamplingMetadata.build([rows[b]]))[0]) == int(together[b])
    keys, positions = torch.tensor([rows[b][3] for b in plain]), torch.tensor([rows[b][4] for b in plain])
    u = uniforms(keys, positions, LANE_SAMPLE, 1)[:, 0]
    scaled = ops.apply_temperature(logits[plain], 0.9)
    _, drawn = kernels.nucleus(scaled, torch.ones(len(plain)), ops.NUCLEUS_RTOL, u)
    assert drawn is not None and torch.equal(drawn, together[plain])
