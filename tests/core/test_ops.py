import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ead_llm.accounting.ledger import forward_flops, parameter_ratio
from ead_llm.core.ops import apply_temperature, best, entropy_bits, filter_logits, row_sum, sorted_descending


def kept(logits: torch.Tensor, top_p: float | list[float] = 1.0, top_k: int | list[int] = 0) -> list:
    """Which tokens the engine's filter keeps (temperature 1) for ``logits`` ``[V]`` or ``[B, V]``."""
    rows = logits if logits.dim() == 2 else logits[None]
    batch = rows.shape[0]
    p = torch.tensor(top_p if isinstance(top_p, list) else [top_p] * batch)
    k = torch.tensor(top_k if isinstance(top_k, list) else [top_k] * batch)
    out = filter_logits(rows, torch.ones(batch), k, p, max_top_k=int(k.max()), any_top_p=bool((p < 1).any()))
    flags = (~torch.isinf(out)).tolist()
    return flags if logits.dim() == 2 else flags[0]


def test_entropy_bits_hand_computed() -> None:
    uniform4 = torch.zeros(4)
    assert entropy_bits(uniform4).item() == pytest.approx(2.0)
    # p = (1/2, 1/4, 1/4): H = 0.5*1 + 2 * 0.25*2 = 1.5 bits
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    assert entropy_bits(logits).item() == pytest.approx(1.5)
    # one certain token, others masked: 0 bits, no NaN from 0 * log 0
    certain = torch.tensor([0.0, float("-inf"), float("-inf")])
    assert entropy_bits(certain).item() == 0.0


def test_entropy_is_shift_invariant_and_batched() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])  # [2, 3]
    out = entropy_bits(logits)
    assert out.shape == (2,)
    assert out[1].item() == pytest.approx(math.log2(3))
    assert entropy_bits(logits + 100.0)[0].item() == pytest.approx(out[0].item(), abs=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rows_sums_and_entropy_are_the_same_bits_alone_and_in_a_batch(threads: int) -> None:
    """Vocabulary-wide sums of one row, alone and among 1-63 others, with torch running 1-3 threads (torch sums a
    lone row split across its threads and a batch's rows one per thread; entropy_bits used to differ for about a
    third of the rows of this test with 2 threads). NaN terms (0 * -inf) count as 0 either way."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for vocab in (100, 49_152, 50_257, 151_936):
            logits = torch.randn(64, vocab, generator=gen) * 3
            logits[::5, :7] = -torch.inf
            batched = entropy_bits(logits)
            sums = row_sum(logits.exp(), torch.float64)
            for rows in (1, 2, 5, 64):
                assert torch.equal(entropy_bits(logits[:rows]), batched[:rows])
                assert torch.equal(row_sum(logits[:rows].exp(), torch.float64), sums[:rows])
            for i in (0, 5, 33, 63):
                assert torch.equal(entropy_bits(logits[i : i + 1]), batched[i : i + 1])
                assert torch.equal(row_sum(logits[i].exp(), torch.float64), sums[i])
            torch.testing.assert_close(sums, logits.exp().sum(-1, dtype=torch.float64), rtol=1e-12, atol=0)
            assert torch.isfinite(batched).all()
    finally:
        torch.set_num_threads(before)


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert kept(logits, 0.7) == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert kept(logits, 0.8) == [True, True, False, False]  # mass before 3rd token is 0.8 >= 0.8
    assert kept(logits, 0.81) == [True, True, True, False]
    assert kept(logits, 0.01) == [True, False, False, False]
    # order of the vocabulary does not matter
    perm = torch.tensor([2, 0, 3, 1])
    assert kept(logits[perm], 0.7) == [False, True, False, True]


def test_top_p_keeps_a_tie_at_its_edge_together() -> None:
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])  # the edge of p = 0.5 falls inside the three-way tie
    assert kept(probs.log(), 0.5) == [True, True, True, True]
    assert kept(probs.log(), 0.4) == [True, False, False, False]  # mass before the tie is 0.4: not below 0.4
    flat = torch.zeros(2, 7)  # all equal: everything is the most likely
    assert kept(flat, 0.01) == [[True] * 7, [True] * 7]
    masked = torch.tensor([[0.0, -math.inf, -math.inf, 1.0]])
    assert kept(masked, 0.999) == [[True, False, False, True]]


def test_top_k_keeps_ties_at_the_cut() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    assert kept(logits, top_k=[2, 1, 0]) == [[True, True, True, True, False], [True] * 5, [True] * 5]


def test_temperature_scales_odds_and_survives_tiny_values() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert torch.softmax(apply_temperature(logits, 1.0), -1)[0].tolist() == pytest.approx([0.25, 0.75])
    # temperature 0.5 squares the odds: 1:9; per row as a tensor too
    assert torch.softmax(apply_temperature(logits, 0.5), -1)[0].tolist() == pytest.approx([0.1, 0.9])
    per_row = apply_temperature(logits.expand(2, 2), torch.tensor([[1.0], [0.5]]))
    assert torch.softmax(per_row, -1)[:, 1].tolist() == pytest.approx([0.75, 0.9])
    tiny = torch.softmax(apply_temperature(logits, 1e-300), -1)
    assert not tiny.isnan().any() and tiny[0].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(logits, 0.0)


def test_top_p_takes_a_threshold_per_row() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2, 4)
    assert kept(logits, [0.7, 0.81]) == [[True, True, False, False], [True, True, True, False]]


def test_parameter_ratio_formula() -> None:
    assert parameter_ratio(0.25, 1, 10) == pytest.approx(0.25 + 0.75 * 0.1)
    assert parameter_ratio(0.0, 3, 12) == pytest.approx(0.25)
    assert parameter_ratio(1.0, 3, 12) == 1.0
    with pytest.raises(ValueError, match="large_fraction"):
        parameter_ratio(1.5, 1, 2)


def test_forward_flops_hand_computed() -> None:
    # 3 new tokens after 2 cached: contexts 3, 4, 5 -> sum 12
    flops = forward_flops(new_tokens=3, past_tokens=2, non_embedding_params=100, num_layers=2, attention_width=8)
    assert flops == 2 * 100 * 3 + 4 * 2 * 8 * 12
    # one pass over 5 tokens equals five single-token passes (same contexts)
    one = forward_flops(new_tokens=5, past_tokens=0, non_embedding_params=7, num_layers=3, attention_width=4)
    steps = sum(
        forward_flops(new_tokens=1, past_tokens=p, non_embedding_params=7, num_layers=3, attention_width=4)
        for p in range(5)
    )
    assert one == steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sorted_descending_is_torch_sort(dtype: torch.dtype) -> None:
    """The CPU shortcut through numpy gives ``torch.sort``'s values in its order: ties, masked tokens (-inf), a
    NaN (first, as torch puts it), negative zeros, in every dtype the sampler may hand it."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.round(torch.randn(4, 5000, generator=gen) * 4) / 4  # many equal values
    rows[1, :1000] = -math.inf
    rows[2, 7] = math.nan
    rows[3, :50] = -0.0
    rows = rows.to(dtype)
    got, want = sorted_descending(rows), torch.sort(rows, dim=-1, descending=True).values
    assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def sorted_floor(given: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus floor of rows ``given`` ``[R, V]`` read off the rows sorted whole (-inf: all kept)."""
    from ead_llm.core import ops

    ordered = sorted_descending(given)
    weights = torch.exp(ordered)
    edge = ops._nucleus_floor(ordered, weights, torch.exp(given).sum(-1, dtype=torch.float64), top_p)
    return torch.where(torch.isnan(edge), -math.inf, edge)


@settings(max_examples=25, deadline=None)
@example(seed=0, vocab=151_936, spread=0.05, step=0.0, top_p=0.9, masked=0)  # Qwen's vocabulary, flat
@example(seed=1, vocab=5000, spread=1.0, step=0.25, top_p=0.6, masked=1000)  # ties at the edge, a grammar's mask
@example(seed=2, vocab=5000, spread=12.0, step=0.0, top_p=0.999, masked=0)  # weights that underflow to 0
@given(
    seed=st.integers(0, 10_000),
    vocab=st.sampled_from([70, 5000, 151_936]),
    spread=st.sampled_from([1e-4, 0.05, 1.0, 12.0]),
    step=st.sampled_from([0.0, 0.25, 2.0**-20]),
    top_p=st.sampled_from([0.05, 0.6, 0.9, 0.999]),
    masked=st.sampled_from([0, 1000]),
)
def test_the_digit_search_finds_the_floor_the_sorted_row_gives(
    seed: int, vocab: int, spread: float, step: float, top_p: float, masked: int
) -> None:
    """The nucleus found a digit at a time equals the one read off the sorted row, to the bit: flat rows (most of
    a 151,936-token row kept), ties (rounded values, several sharing every digit but the last), masked tokens,
    weights that underflow; a row alone gets the floor it gets in a batch."""
    from ead_llm.core.ops import nucleus_by_digits

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=gen) * spread
    if step:
        logits = torch.round(logits / step) * step
    logits[1, : min(masked, vocab - 1)] = -math.inf
    given = apply_temperature(logits, 1.0)
    p = torch.full((3,), top_p)
    weights = torch.exp(given)
    total = weights.sum(-1, dtype=torch.float64)
    found, want = nucleus_by_digits(given, weights, total, p), sorted_floor(given, p)
    assert torch.equal(given >= found[:, None], given >= want[:, None])
    finite = want > -math.inf  # a row that keeps everything may also say so with its smallest value
    assert torch.equal(found[finite], want[finite])
    for b in range(3):
        alone = nucleus_by_digits(given[b : b + 1], weights[b : b + 1], total[b : b + 1], p[:1])
        assert torch.equal(alone, found[b : b + 1])


def test_the_digit_search_keeps_a_tie_at_the_edge_and_an_edge_on_a_token() -> None:
    """Engineered edges: a tie group straddling the nucleus's edge is kept whole; mass that reaches top_p exactly at
    a token (0.5 + 0.3 at 0.8) stops there, as the sorted rule does; top_p reached at the very largest value keeps it
    alone."""
    from ead_llm.core.ops import nucleus_by_digits

    def floor(probs: list[float], top_p: float, pad: int = 3000) -> float:
        row = torch.tensor(probs + [1e-12] * pad, dtype=torch.float64).log().float()
        given = row - row.max()
        weights = torch.exp(given)[None]
        return float(
            nucleus_by_digits(given[None], weights, weights.sum(-1, dtype=torch.float64), torch.tensor([top_p]))
        )

    tie = math.log(0.2 / 0.4)
    assert floor([0.4, 0.2, 0.2, 0.2], 0.5) == pytest.approx(tie)  # the three 0.2s, all kept
    assert floor([0.5, 0.3, 0.2], 0.8) == pytest.approx(math.log(0.3 / 0.5))  # 0.2 dropped
    assert floor([0.9, 0.05, 0.05], 0.5) == 0.0


def test_the_filter_sorts_rows_it_cannot_search_by_digits() -> None:
    """Values above 0 (a caller that did not shift them) or a NaN: the whole row is sorted instead, and the kept set
    is still the plain rule's."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(2, 4000, generator=gen) * 0.05 + 3.0  # flat: the nucleus reaches past 1,024 tokens
    from ead_llm.core import ops

    floor = ops.kept_floor(
        rows, torch.zeros(2, dtype=torch.long), torch.full((2,), 0.9), max_top_k=0, any_top_p=True
    ).floor
    ordered = sorted_descending(rows)
    weights = torch.exp(ordered)
    want = ops._nucleus_floor(ordered, weights, torch.exp(rows).sum(-1, dtype=torch.float64), torch.full((2,), 0.9))
    assert torch.equal(floor, want)


def test_a_digit_is_the_first_whose_mass_reaches_the_threshold_and_never_one_without_mass() -> None:
    """One digit of the search: mass exactly at the threshold reaches it (the sorted rule's ``>=``); a threshold the
    digits' sums fall short of by rounding picks the last digit holding mass, never an empty one past it."""
    from ead_llm.core.ops import _next_digit

    slots, mass = torch.tensor([0, 1, 5, 6]), torch.tensor([0.25, 0.25, 0.5, 0.0], dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    prefix = torch.zeros(2, dtype=torch.int64)
    before, found = _next_digit(slots, mass, 2, zero, prefix, torch.tensor([0.25, 0.5 + 1e-12], dtype=torch.float64))
    assert found.tolist() == [
        0,
        1,
    ]  # row 0 reaches 0.25 at its first digit; row 1's sums never reach: its last with mass
    assert before.tolist() == [0.0, 0.0]
    before, found = _next_digit(slots, mass, 2, zero, prefix + 1, torch.tensor([0.5, 0.1], dtype=torch.float64))
    assert found.tolist() == [(1 << 2) | 1, (1 << 2) | 1] and before.tolist() == [0.25, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_best_is_argmax_the_lowest_id_among_ties_with_infinities_and_nans(dtype: torch.dtype, threads: int) -> None:
    """``best`` (``torch.max``'s indices, faster on the CPU) picks what ``torch.argmax`` picks: the first of equal
    maxima, on rows of few distinct values (ties everywhere), wide and narrow, rows of ``-inf``, ``inf`` maxima, a
    NaN (the maximum), strided views and rounds ``[R, G, V]``."""
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for trial in range(60):
            vocab = int(torch.randint(1, 300 if trial % 2 else 70_000, (), generator=gen))
            x = torch.randint(-3, 3, (5, vocab), generator=gen).to(dtype)
            if trial % 5 == 0:
                x[:, torch.randint(0, vocab, (3,), generator=gen)] = float("inf")
            if trial % 7 == 0:
                x[1] = -float("inf")
            if trial % 11 == 0:
                x[2, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
            for view in (x, x[:, ::2], x.t().contiguous().t(), x[None].expand(3, -1, -1)):
                assert torch.equal(best(view), torch.argmax(view, dim=-1))
    finally:
        torch.set_num_threads(before)
