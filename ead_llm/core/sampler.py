"""The sampler: a pass's next-token logits ``[B, V]`` and per-row settings -> tokens ``[B]``, entropies ``[B]``.

Everything runs batched on the logits' device; settings arrive as tensors, one value per row.
Greedy rows are one argmax (the lowest id among equal maxima). Sampled rows draw one token by
inverse CDF, in token-id order, from the distribution of :func:`ead_llm.core.ops.filtered_probs`
(temperature, top-k, top-p, ties at each cut kept): the same function speculative verification and
its recovery draw use, so the drafts, the large model's verdict and plain sampling agree on what
can be drawn. Uniforms come from a counter-based generator (:func:`uniforms`): the numbers a row
gets depend only on its request's key and the position being sampled, so a seed gives the same
text whatever else is in the batch, on any device, and a draw that is thrown away (a withheld or
rolled-back token) shifts nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ead_llm.core.ops import (
    apply_temperature,
    best,
    candidate_width,
    entropy_and_best,
    entropy_bits,
    kept_floor,
    native_nucleus,
    on_kernel,
    piece_sums,
    sorts_whole_rows,
    top_k_entropy_nats,
)
from ead_llm.core.transfer import upload
from ead_llm.core.types import Role, TokenSample

CHUNK = 1024
"""Inverse-CDF draws over a whole vocabulary find the chunk of this many tokens first, then the token."""
LANE_SAMPLE, LANE_ACCEPT, LANE_RESIDUAL = 0, 1, 2
"""Independent uniform streams per position: sampling, speculative acceptance, and the token drawn after a
verification."""

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
    sums = piece_sums(weights, CHUNK, torch.float64)  # [B, C]
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
    any_top_p: bool
    sampled_rows: torch.Tensor | None = None
    """[S] int64 rows that sample (temperature > 0), known on the host; None when every row samples."""

    @staticmethod
    def build(
        rows: Sequence[tuple[float, int, float, int, int]], device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        """From ``(temperature, top_k, top_p, key, position)`` per row (an all-greedy pass needs no tensors)."""
        temperature, top_k, top_p, keys, positions = zip(*rows, strict=True) if rows else ((), (), (), (), ())
        sampled = [t > 0 for t in temperature]
        if not any(sampled):
            return GREEDY
        floats = upload([temperature, top_p], torch.float32, device)
        ints = upload([top_k, keys, positions], torch.int64, device)
        return SamplingMetadata(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            keys=ints[1],
            positions=ints[2],
            all_greedy=False,
            max_top_k=max((k for k, s in zip(top_k, sampled, strict=True) if s), default=0),
            any_top_p=any(p < 1.0 for p, s in zip(top_p, sampled, strict=True) if s),
            sampled_rows=None if all(sampled) else upload([b for b, s in enumerate(sampled) if s], torch.int64, device),
        )


_NONE = torch.empty(0)
GREEDY = SamplingMetadata(_NONE, _NONE, _NONE, _NONE, _NONE, all_greedy=True, max_top_k=0, any_top_p=False)
"""The settings of a pass where every row is greedy."""


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler gives for one pass (all on the logits' device)."""

    tokens: torch.Tensor
    """[B] int64."""
    entropy_bits: torch.Tensor
    """[B] float32: entropy of each row's raw logits (before temperature), in bits."""


BLOCK_BYTES = 4 << 20
"""On a CPU a pass's rows are sampled in blocks of about this many bytes of logits, so that the dozen operations
over a block's rows find them in the cache: 64 flat rows of 151,936 tokens sampled at once ran 2.7x slower than in
blocks of 4 to 8 rows (the same tokens; each row's draw depends on the row alone)."""


def row_blocks(rows: int, vocab: int, device: torch.device) -> list[slice]:
    """Slices of ``rows`` rows of ``vocab`` float32 logits, each about :data:`BLOCK_BYTES` (one on a GPU)."""
    per = rows if device.type != "cpu" else max(1, BLOCK_BYTES // (4 * max(1, vocab)))
    return [slice(start, min(rows, start + per)) for start in range(0, rows, max(1, per))]


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Tokens ``[B]`` for raw ``logits`` ``[B, V]`` under ``meta`` (see the module docstring).

    A sampled row draws by inverse CDF in token-id order over the tokens :func:`ead_llm.core.ops.kept_floor`
    keeps: among its candidates when they hold the whole kept set (the usual case with top-k or top-p),
    else over the vocabulary. Which of the two depends on the row alone, so a seed's draws never depend on
    the batch (nor on the :func:`row_blocks` the rows are drawn in). On a device whose filter sorts rows whole (a
    GPU: :func:`ead_llm.core.ops.sorts_whole_rows`) every row draws over the vocabulary, so that no step looks at
    the data. Where the kernel runs, a row without top-k takes its floor and draw from it
    (:func:`ead_llm.core.ops.native_nucleus`: the same kept set, every token at top-p 1, drawn over the vocabulary in
    token order)."""
    if meta.all_greedy:
        return best(logits)  # [B], the first of equal maxima
    rows = meta.sampled_rows  # only the sampled rows are filtered
    count = len(logits) if rows is None else len(rows)
    blocks = row_blocks(count, logits.shape[-1], logits.device)
    drawn = torch.cat([_draw(logits, meta, block) for block in blocks]) if len(blocks) > 1 else _draw(logits, meta)
    return drawn if rows is None else best(logits).index_copy(0, rows, drawn)


def _draw(logits: torch.Tensor, meta: SamplingMetadata, block: slice | None = None) -> torch.Tensor:
    """The draws of the sampled rows ``block`` of ``meta`` (all of them when None) -> ``[S]``."""
    rows = meta.sampled_rows
    if rows is not None and block is not None:
        rows = rows[block]

    def pick(x: torch.Tensor) -> torch.Tensor:
        if rows is not None:
            return x[rows]
        return x if block is None else x[block]

    scaled = apply_temperature(pick(logits), pick(meta.temperature)[:, None])  # [S, V]
    u = uniforms(pick(meta.keys), pick(meta.positions), LANE_SAMPLE, 1)  # [S, 1]
    if not meta.max_top_k and not meta.any_top_p and not on_kernel(scaled):
        return inverse_cdf(torch.exp(scaled), u)[:, 0]
    return _filtered_draw(scaled, pick(meta.top_k), pick(meta.top_p), u, meta)


def _filtered_draw(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, meta: SamplingMetadata
) -> torch.Tensor:
    """One draw per row of ``scaled`` ``[S, V]`` from its kept set (see :func:`sample`)."""
    vocab = scaled.shape[-1]
    plain = top_k <= 0  # rows without top-k: the kernel's floor (-inf at top-p 1) and draw, where it runs
    if not sorts_whole_rows(scaled) and on_kernel(scaled) and bool(plain.any()):
        return _kernel_draw(scaled, top_k, top_p, u, meta, plain.nonzero().flatten())
    kept_set = kept_floor(scaled, top_k, top_p, max_top_k=meta.max_top_k, any_top_p=meta.any_top_p)
    floor, values, ids = kept_set.floor, kept_set.values, kept_set.ids
    if sorts_whole_rows(scaled):  # every row over the vocabulary: no step that depends on the data
        return inverse_cdf(torch.where(scaled >= floor[:, None], torch.exp(scaled), 0.0), u)[:, 0]
    own = candidate_width(top_k, vocab)
    # every kept token is a candidate when the row's last candidate is below its floor (or all are candidates)
    fits = (values.gather(1, (own - 1)[:, None]).squeeze(1) < floor) | (own >= vocab)
    kept = (values >= floor[:, None]) & (torch.arange(values.shape[-1], device=scaled.device)[None, :] < own[:, None])
    by_id, order = torch.sort(torch.where(kept, ids, vocab), dim=-1)  # candidates in token-id order
    weights = torch.where(kept, torch.exp(values), 0.0).gather(1, order)
    drawn = by_id.gather(1, inverse_cdf(weights, u))[:, 0]
    wide = (~fits).nonzero().flatten()
    if len(wide):  # rows whose kept set reaches past their candidates draw over the vocabulary
        drawn[wide] = inverse_cdf(kept_set.kept_weights(wide, scaled), u[wide])[:, 0]
    return drawn


def _kernel_draw(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    meta: SamplingMetadata,
    plain: torch.Tensor,
) -> torch.Tensor:
    """:func:`_filtered_draw` with its ``plain`` rows (without top-k) drawn by the kernel
    (:func:`ead_llm.core.ops.native_nucleus`), the others (top-k rows) as it draws them."""
    whole = len(plain) == len(scaled)
    mine = scaled if whole else scaled[plain]
    mine_u = u if whole else u[plain]
    floor, tokens = native_nucleus(mine, top_p if whole else top_p[plain], u=mine_u)
    assert tokens is not None
    odd = (tokens < 0).nonzero().flatten()
    if len(odd):  # a row the kernel leaves (a NaN in it): the torch search's floor it gave, a draw over the row
        weights = torch.where(mine[odd] >= floor[odd, None], torch.exp(mine[odd]), 0.0)
        tokens[odd] = inverse_cdf(weights, mine_u[odd])[:, 0]
    if whole:
        return tokens
    drawn = torch.empty(len(scaled), dtype=torch.int64)
    drawn[plain] = tokens
    cut = (top_k > 0).nonzero().flatten()
    drawn[cut] = _filtered_draw(scaled[cut], top_k[cut], top_p[cut], u[cut], meta)
    return drawn


class Sampler:
    """Samples a pass's rows in one batch; see the module docstring."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """``logits``: [B, V] float32 raw logits of the producing model."""
        blocks = row_blocks(len(logits), logits.shape[-1], logits.device)
        if meta.all_greedy:  # each row's entropy and most likely token in one read (through the kernel)
            if len(blocks) == 1:
                entropy, tokens = entropy_and_best(logits)
            else:
                parts = [entropy_and_best(logits[b]) for b in blocks]
                entropy, tokens = torch.cat([e for e, _ in parts]), torch.cat([t for _, t in parts])
            return SamplerOutput(tokens=tokens, entropy_bits=entropy)
        entropy = torch.cat([entropy_bits(logits[b]) for b in blocks]) if len(blocks) > 1 else entropy_bits(logits)
        return SamplerOutput(tokens=sample(logits, meta), entropy_bits=entropy)


@dataclass(frozen=True)
class SampledRows:
    """Sampled rows of one pass, on the device until the pass's one host sync."""

    role: Role
    rows: list[int]
    """The pass's row of each."""
    logits: torch.Tensor
    """[b, V] their (masked) logits: a draft keeps its row for its verification."""
    tokens: torch.Tensor
    """[b] int64."""
    entropy: torch.Tensor
    """[b] float32 bits."""
    branch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """Top-1 and top-2 tokens and EAGER's entropy (nats over each row's top-k), ``[b]`` each, when asked for."""
    keep_logits: bool = True
    """Whether each sample carries its row of ``logits`` (False: None, where no decoder of the rows reads them)."""

    def columns(self) -> list[torch.Tensor]:
        return [self.tokens, self.entropy, *(self.branch or ())]

    def results(self, host: list[list[float]]) -> list[tuple[int, TokenSample]]:
        """Each row's :class:`TokenSample`, from :meth:`columns` on the host."""
        tokens, entropies, *branch = host
        role, none = self.role, (None,) * len(self.rows)
        views = self.logits.unbind(0) if self.keep_logits else none  # unbind: one call, not one per row
        top2 = [(int(a), int(b)) for a, b in zip(branch[0], branch[1], strict=True)] if branch else none
        nats = branch[2] if branch else none
        return [
            (row, TokenSample(role, int(tokens[j]), entropies[j], views[j], top2[j], nats[j]))
            for j, row in enumerate(self.rows)
        ]


class DeviceResults(Protocol):
    """A pass's results on the device (:class:`SampledRows`, the rejection sampler's ``JudgedRounds``)."""

    def columns(self) -> list[torch.Tensor]: ...

    def results(self, host: list[list[float]]) -> list[tuple[int, Any]]: ...


def to_host(parts: Sequence[DeviceResults]) -> list[tuple[int, Any]]:
    """Every part's ``(pass row, result)``, with all their columns brought to the host in one transfer (the pass's
    one sync), in row order."""
    per_part = [part.columns() for part in parts]
    columns = [column for own in per_part for column in own]
    if not columns:
        return []
    flat = torch.cat([c.reshape(-1).to(torch.float64) for c in columns]).tolist()
    host, at = [], 0
    for column in columns:
        host.append(flat[at : at + column.numel()])
        at += column.numel()
    results, first = [], 0
    for part, own in zip(parts, per_part, strict=True):
        results.extend(part.results(host[first : first + len(own)]))
        first += len(own)
    return sorted(results, key=lambda item: item[0])


def branch_entropy(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """EAGER's entropy of each row of ``logits`` ``[B, V]``: nats over its ``top_ks`` most likely tokens -> ``[B]``."""
    if len(set(top_ks)) == 1:
        return top_k_entropy_nats(logits, top_ks[0])
    out = torch.empty(len(top_ks), device=logits.device)
    for k in set(top_ks):
        index = upload([b for b, v in enumerate(top_ks) if v == k], torch.int64, logits.device)
        out[index] = top_k_entropy_nats(logits[index], k)
    return out
