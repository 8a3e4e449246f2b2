"""The sampler: a pass's next-token logits ``[B, V]`` and per-row settings -> tokens ``[B]``, entropies ``[B]``.

Everything runs batched on the logits' device; settings arrive as tensors, one value per row.
Greedy rows are one argmax. Sampled rows draw by inverse CDF with uniforms from a counter-based
generator (:func:`uniforms`): the numbers a row gets depend only on its request's key and the
position being sampled, so a seed gives the same text whatever else is in the batch, on any
device, and a draw that is thrown away (a withheld or rolled-back token) shifts nothing.

Top-k keeps the k most likely tokens (``torch.topk``: no full sort). Top-p is exact without a
sort of the vocabulary: a row's draws come from the (temperature, top-k) distribution and the
first one inside the nucleus is kept (``mass of strictly more likely tokens < top_p``), which is a
draw from the renormalised nucleus. With ``DRAWS`` candidates a row misses only when the nucleus
mass is small and every candidate falls outside it; those rows (flagged ``missed``) are redrawn by
:meth:`Sampler.resample_missed` with the sort-based filter, so every draw is exact.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ead_llm.core.ops import apply_temperature, entropy_bits, top_p_filter

DRAWS = 2
"""Candidate draws per row for top-p (a row misses with probability (1 - nucleus mass) ** DRAWS, and is
then redrawn exactly; each further candidate costs a pass over the vocabulary)."""
CHUNK = 1024
"""Inverse-CDF draws over a whole vocabulary find the chunk of this many tokens first, then the token."""
LANE_SAMPLE, LANE_ACCEPT, LANE_RESIDUAL, LANE_RESAMPLE = 0, 1, 2, 3
"""Independent uniform streams per position: sampling, speculative acceptance, the token drawn after a
verification, and the exact redraw of a missed row."""

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (wrapping arithmetic): a bijective 64-bit mix."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniforms(keys: torch.Tensor, positions: torch.Tensor, lane: int, count: int) -> torch.Tensor:
    """``count`` uniforms in [0, 1) per row ``[B, count]`` (float64), fixed by (key, position, lane, j).

    ``keys``, ``positions``: [B] int64. Same inputs, same numbers, on any device and in any batch.
    """
    row = splitmix64(keys ^ splitmix64(positions * 4 + lane))  # [B]
    offsets = torch.arange(count, device=keys.device, dtype=torch.int64)
    bits = _shift_right(splitmix64(row[:, None] + offsets[None, :] * _GOLDEN), 11)  # [B, count], 53 bits
    return bits.to(torch.float64) / float(2**53)


def _int64(value: int) -> int:
    """``value`` wrapped into int64's range."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def _mix(value: int) -> int:
    return int(splitmix64(torch.tensor([_int64(value)], dtype=torch.int64)).item())


def stream_key(seed: int | None, stream: int) -> int:
    """The random key of stream ``stream`` of ``seed`` (a fresh random key when ``seed`` is None)."""
    if seed is None:
        return secrets.randbits(63)
    return _mix(seed * 1_000_003 + stream)


def fork_key(key: int, position: int) -> int:
    """The key of a path branched off a sequence with ``key`` at ``position`` (EAGER)."""
    return _mix(key ^ _int64(position * 0x2545F4914F6CDD1D))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices drawn from the rows of ``weights`` ``[B, V]`` (unnormalised, >= 0) by ``u`` ``[B, D]`` -> ``[B, D]``.

    Exact in float64 without a cumulative sum of the whole row: chunk sums locate each draw's chunk
    of :data:`CHUNK` tokens, then a cumulative sum of that chunk alone finds the token. A draw never
    lands on a zero weight.
    """
    rows, vocab = weights.shape
    if vocab <= CHUNK:
        return _draw_in(weights.to(torch.float64), u * weights.sum(-1, dtype=torch.float64)[:, None])
    full = vocab // CHUNK
    sums = weights[:, : full * CHUNK].reshape(rows, full, CHUNK).sum(-1, dtype=torch.float64)  # [B, C]
    if full * CHUNK < vocab:
        sums = torch.cat([sums, weights[:, full * CHUNK :].sum(-1, keepdim=True, dtype=torch.float64)], dim=1)
    before = torch.cumsum(sums, dim=-1) - sums  # [B, C] mass of the chunks before each
    target = u * (before[:, -1:] + sums[:, -1:])  # [B, D]
    chunk = _draw_in(sums, target)  # [B, D]
    offsets = torch.arange(CHUNK, device=weights.device)
    index = (chunk * CHUNK)[..., None] + offsets  # [B, D, CHUNK]
    inside = index < vocab
    values = weights.gather(1, index.clamp(max=vocab - 1).reshape(rows, -1)).reshape(index.shape)
    values = torch.where(inside, values.to(torch.float64), 0.0)
    local = target - before.gather(1, chunk)  # [B, D]
    return chunk * CHUNK + _draw_in(values.reshape(-1, CHUNK), local.reshape(-1, 1)).reshape(local.shape)


def _draw_in(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` ``[R, N]`` (float64, >= 0): the index whose cumulative weight first exceeds each
    ``target`` ``[R, D]``, clamped to the last positive weight (rounding at the very end of a row)."""
    cdf = torch.cumsum(weights, dim=-1)
    index = torch.searchsorted(cdf, target.contiguous(), right=True)
    last = (weights > 0).to(torch.int64).cumsum(-1).argmax(-1, keepdim=True)  # the last positive weight
    return torch.minimum(index, last)


def in_nucleus(weights: torch.Tensor, tokens: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Whether each of ``tokens`` ``[B, D]`` lies in its row's top-p nucleus of ``weights`` ``[B, V]``
    (unnormalised): the mass of the strictly more likely tokens is below ``top_p`` ``[B]`` of the total
    (so the most likely token always is). One pass over the vocabulary per candidate."""
    chosen = weights.gather(1, tokens)  # [B, D]
    total = weights.sum(-1, dtype=torch.float64)
    before = torch.stack(
        [
            torch.where(weights > chosen[:, j : j + 1], weights, 0.0).sum(-1, dtype=torch.float64)
            for j in range(tokens.shape[1])
        ],
        dim=1,
    )  # [B, D]
    return before < (top_p.to(torch.float64) * total)[:, None]


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_top_k: int,
    any_top_p: bool,
) -> torch.Tensor:
    """Sampling distributions ``[B, V]`` after temperature, top-k and top-p, per row (temperature > 0).

    ``logits``: [B, V] raw; ``temperature``, ``top_p``: [B] float; ``top_k``: [B] int (0: off), at most
    ``max_top_k``; ``any_top_p``: whether a row's ``top_p`` is below 1. Exact, with one sort of the
    rows when one uses top-p: for where a whole distribution is needed (speculative verification,
    a missed draw's redraw), not to draw a token in the common case.
    """
    scaled = top_k_rows(apply_temperature(logits, temperature[:, None]), top_k, max_top_k)
    if any_top_p:
        scaled = top_p_filter(scaled, top_p[:, None])
    return torch.softmax(scaled, dim=-1)


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings of one pass as tensors on the logits' device."""

    temperature: torch.Tensor
    """[B] float32; 0 marks a greedy row."""
    top_k: torch.Tensor
    """[B] int64; 0 keeps every token."""
    top_p: torch.Tensor
    """[B] float32 in (0, 1]."""
    keys: torch.Tensor
    """[B] int64 random key of each row's request stream."""
    positions: torch.Tensor
    """[B] int64 position of the token each row samples (the generator's counter)."""
    all_greedy: bool
    max_top_k: int
    """Largest top-k of a sampled row (0: none uses top-k)."""
    any_full: bool
    """Whether a sampled row draws from its whole vocabulary (top-k off)."""
    any_top_p: bool

    @staticmethod
    def build(
        rows: Sequence[tuple[float, int, float, int, int]], device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        """From ``(temperature, top_k, top_p, key, position)`` per row (an all-greedy pass needs no tensors)."""
        temperature, top_k, top_p, keys, positions = zip(*rows, strict=True) if rows else ((), (), (), (), ())
        sampled = [t > 0 for t in temperature]
        if not any(sampled):
            return GREEDY
        return SamplingMetadata(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            keys=torch.tensor(keys, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            all_greedy=not any(sampled),
            max_top_k=max((k for k, s in zip(top_k, sampled, strict=True) if s), default=0),
            any_full=any(k == 0 for k, s in zip(top_k, sampled, strict=True) if s),
            any_top_p=any(p < 1.0 for p, s in zip(top_p, sampled, strict=True) if s),
        )


_NONE = torch.empty(0)
GREEDY = SamplingMetadata(
    _NONE, _NONE, _NONE, _NONE, _NONE, all_greedy=True, max_top_k=0, any_full=False, any_top_p=False
)
"""The settings of a pass where every row is greedy."""


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler gives for one pass (all on the logits' device)."""

    tokens: torch.Tensor
    """[B] int64."""
    entropy_bits: torch.Tensor
    """[B] float32: entropy of each row's raw logits (before temperature), in bits."""
    missed: torch.Tensor | None
    """[B] bool where every top-p candidate fell outside the nucleus (redraw with ``resample_missed``);
    None when no row uses top-p."""


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens ``[B]`` for raw ``logits`` ``[B, V]`` under ``meta``, and the rows that missed (see module doc)."""
    greedy = torch.argmax(logits, dim=-1)  # [B]
    if meta.all_greedy:
        return greedy, None
    vocab = logits.shape[-1]
    sampled = meta.temperature > 0
    temperature = torch.where(sampled, meta.temperature, 1.0)
    scaled = apply_temperature(logits, temperature[:, None])  # [B, V]
    u = uniforms(meta.keys, meta.positions, LANE_SAMPLE, DRAWS)  # [B, D]
    candidates = torch.zeros_like(u, dtype=torch.int64)
    inside = torch.ones_like(u, dtype=torch.bool)
    if meta.max_top_k:  # rows with top-k draw among their k most likely tokens, and judge top-p there
        k = min(vocab, meta.max_top_k)
        values, index = torch.topk(scaled, k, dim=-1)  # [B, k], sorted
        limit = torch.where(meta.top_k > 0, meta.top_k, k)
        values = values.masked_fill(torch.arange(k, device=logits.device)[None, :] >= limit[:, None], -torch.inf)
        weights = torch.exp(values)  # [B, k], the row's maximum is 1
        picked = inverse_cdf(weights, u)  # [B, D] positions among the k
        candidates = index.gather(1, picked)
        if meta.any_top_p:
            inside = in_nucleus(weights, picked, meta.top_p)
    if meta.any_full:  # rows without top-k draw from the whole vocabulary
        weights = torch.exp(scaled)  # [B, V]
        full = inverse_cdf(weights, u)  # [B, D]
        uses_k = (meta.top_k > 0)[:, None]
        candidates = torch.where(uses_k, candidates, full)
        if meta.any_top_p:
            inside = torch.where(uses_k, inside, in_nucleus(weights, full, meta.top_p))
    missed = None
    if meta.any_top_p:
        inside = inside | (meta.top_p >= 1.0)[:, None]  # [B, D]
        first = torch.argmax(inside.to(torch.int8), dim=1)  # the first candidate inside (0 if none)
        tokens = candidates.gather(1, first[:, None]).squeeze(1)
        missed = sampled & ~inside.any(dim=1)
    else:
        tokens = candidates[:, 0]
    return torch.where(sampled, tokens, greedy), missed


def top_k_rows(scaled: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """``scaled`` ``[B, V]`` with each row's tokens below its ``top_k``-th largest set to -inf (ties at the
    cut kept; ``top_k`` ``[B]``, 0 keeps the row; ``max_top_k``: the largest of them)."""
    if max_top_k == 0:
        return scaled
    k = min(max_top_k, scaled.shape[-1])
    kth = torch.topk(scaled, k, dim=-1).values  # [B, k], sorted
    cut = kth.gather(1, (torch.clamp(top_k, min=1, max=k) - 1)[:, None])  # [B, 1]
    return torch.where((top_k > 0)[:, None] & (scaled < cut), -torch.inf, scaled)


class Sampler:
    """Samples a pass's rows in one batch; see the module docstring."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """``logits``: [B, V] float32 raw logits of the producing model."""
        tokens, missed = sample(logits, meta)
        return SamplerOutput(tokens=tokens, entropy_bits=entropy_bits(logits), missed=missed)

    @staticmethod
    def resample_missed(logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> list[int]:
        """Exact draws (sort-based filters) for ``rows`` whose top-p candidates all missed; rare."""
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        probs = filtered_probs(
            logits[index],
            meta.temperature[index],
            meta.top_k[index],
            meta.top_p[index],
            max_top_k=meta.max_top_k,
            any_top_p=True,
        )
        u = uniforms(meta.keys[index], meta.positions[index], LANE_RESAMPLE, 1)
        return inverse_cdf(probs, u)[:, 0].tolist()
