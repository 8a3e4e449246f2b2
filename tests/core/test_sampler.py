"""The batched sampler: counter-based uniforms, greedy rows, exact temperature / top-k / top-p draws."""

from __future__ import annotations

import math

import pytest
import torch

from ead_llm.core.ops import apply_temperature, top_p_filter
from ead_llm.core.sampler import (
    CHUNK,
    LANE_ACCEPT,
    LANE_SAMPLE,
    Sampler,
    SamplingMetadata,
    filtered_probs,
    fork_key,
    inverse_cdf,
    sample,
    stream_key,
    uniforms,
)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a row must be drawn from, written out plainly: temperature, top-k, top-p."""
    scaled = apply_temperature(logits, temperature)
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    return torch.softmax(top_p_filter(scaled, top_p), dim=-1)


def draw_many(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, n: int) -> torch.Tensor:
    """``n`` draws of one row, one per position (so each uses fresh uniforms), missed rows redrawn."""
    rows = logits[None].expand(n, -1)
    meta = SamplingMetadata.build([(temperature, top_k, top_p, 1234, position) for position in range(n)])
    tokens, missed = sample(rows, meta)
    if missed is not None and bool(missed.any()):
        redo = missed.nonzero().flatten().tolist()
        tokens[redo] = torch.tensor(Sampler.resample_missed(rows, meta, redo))
    return tokens


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
    assert Sampler()(logits, SamplingMetadata.build([(0.0, 0, 1.0, 0, 0)] * 5)).missed is None


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


def test_a_flat_distribution_with_a_small_nucleus_is_redrawn_exactly() -> None:
    logits = torch.zeros(400)  # uniform: top-p 0.05 keeps about 20 tokens, most candidates miss
    logits[:20] = 0.01  # the nucleus: the 20 (slightly) most likely tokens
    n = 3000
    meta = SamplingMetadata.build([(1.0, 0, 0.05, 9, position) for position in range(n)])
    _, missed = sample(logits[None].expand(n, -1), meta)
    assert missed is not None and int(missed.sum()) > n // 2  # most rows need the exact redraw
    tokens = draw_many(logits, 1.0, 0, 0.05, n)
    assert set(tokens.tolist()) <= set(range(20))
    assert total_variation(tokens, reference_probs(logits, 1.0, 0, 0.05)) < 0.06


def test_a_seed_gives_the_same_draws_on_any_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, 50)
    rows = [(1.0, 0, 0.9, stream_key(7, b), 11) for b in range(8)]
    together = sample(logits, SamplingMetadata.build(rows))[0]
    reversed_rows = sample(logits.flip(0), SamplingMetadata.build(rows[::-1]))[0].flip(0)
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
