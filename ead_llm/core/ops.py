"""Side-effect-free tensor and cost math used by the engine, the sampler and the ledger."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ead_llm.core import kernels

LOG2E = 1.0 / math.log(2.0)
TINY = 1e-30
"""The smallest temperature divided by (a smaller one is as greedy and would overflow float32)."""


ROW_PIECE = 128
""":func:`row_sum` adds a row up in pieces of this many values."""


def piece_sums(
    values: torch.Tensor, size: int, dtype: torch.dtype | None = None, *, skip_nan: bool = False
) -> torch.Tensor:
    """The sum of each piece of ``size`` values along the last dimension of ``values`` ``[..., V]`` (the last piece
    shorter): ``[..., ceil(V / size)]`` in ``dtype`` (``skip_nan``: NaN counts as 0). Each piece is summed on its own,
    in one thread, so its bits depend on nothing else in the call."""
    add = torch.nansum if skip_nan else torch.sum
    full = values.shape[-1] // size * size
    sums = add(values[..., :full].reshape(*values.shape[:-1], -1, size), dim=-1, dtype=dtype)
    if full < values.shape[-1]:
        sums = torch.cat([sums, add(values[..., full:], dim=-1, keepdim=True, dtype=dtype)], dim=-1)
    return sums


def row_sum(values: torch.Tensor, dtype: torch.dtype | None = None, *, skip_nan: bool = False) -> torch.Tensor:
    """The sums over the last dimension of ``values`` ``[..., V]`` (in ``dtype``; ``skip_nan``: NaN counts as 0),
    the same bits for a row whatever rows are summed with it and however many threads torch runs. (torch sums the
    one row of a one-row call split across its threads, and the rows of a batch one per thread, in two orders.)
    Here the row's :func:`piece_sums` of :data:`ROW_PIECE` values, then those (too few to split)."""
    return piece_sums(values, ROW_PIECE, dtype, skip_nan=skip_nan).sum(-1)


def entropy_bits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of ``softmax(logits)`` over the last dimension.

    ``logits``: [..., V] raw logits (before temperature); returns [...] float32, the same bits for a row alone or in
    a batch (:func:`row_sum`). ``-inf`` logits (masked tokens) contribute nothing (their ``0 * -inf`` terms are
    skipped).
    """
    logits = logits.float()
    if not on_kernel(logits):
        return _entropy_bits(logits)
    return _row_stats(logits, best=False)[0]


def entropy_and_best(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`entropy_bits` and :func:`best` of ``logits`` ``[..., V]`` together: one read of the rows fewer through
    the kernel (a greedy pass's sampler)."""
    if not on_kernel(logits):
        return entropy_bits(logits), best(logits)
    return _row_stats(logits)


def _row_stats(logits: torch.Tensor, *, entropy: bool = True, best: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's entropy and most likely id of float32 ``logits`` ``[..., V]`` (each ``[...]``; what is not asked
    for is left empty); rows holding a NaN or +inf, or nothing above -inf, get torch's formula and rule
    (:func:`_entropy_bits`, ``max``'s index)."""
    rows = logits.reshape(-1, logits.shape[-1])
    bits, ids = kernels.row_stats(rows, entropy=entropy, best=best)
    odd = torch.isnan(bits) if entropy else ids < 0
    if bool(odd.any()):
        if entropy:
            bits[odd] = _entropy_bits(rows[odd])
        if best:
            ids[odd] = rows[odd].max(dim=-1).indices
    shape = logits.shape[:-1]
    return bits.reshape(shape) if entropy else bits, ids.reshape(shape) if best else ids


def _entropy_bits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)  # [..., V]
    return -row_sum(logp.exp() * logp, skip_nan=True) * LOG2E


def on_kernel(logits: torch.Tensor) -> bool:
    """Whether ``logits`` go through the kernel's per-row calls (:func:`~ead_llm.core.kernels.row_stats`,
    :func:`~ead_llm.core.kernels.nucleus`): float32 rows on a CPU where it runs. ``row_stats`` reads a row three
    times for what torch's operations read six (a 49,152-token row's entropy and most likely id: 0.10 against 0.53 ms,
    one thread), and its entropy is the closer to a float64 one's (1e-6 against 5e-5 bits over 151,936 tokens)."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() > 0
        and logits.numel() > 0
        and kernels.available()
    )


def apply_temperature(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Scale ``logits`` [..., V] by ``1 / temperature`` (> 0; a float, or a tensor broadcasting against the
    logits such as [B, 1]), after shifting each row's maximum to 0: the same distribution, but a tiny
    temperature cannot overflow to inf (and NaN)."""
    if isinstance(temperature, (int, float)):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 here, got {temperature}")
        temperature = max(float(temperature), TINY)
    else:
        temperature = torch.clamp(temperature, min=TINY)
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    # a temperature below float32's range would divide by 0; at TINY the maxima stay 0, the rest -inf
    return shifted / temperature


CANDIDATES = 64
"""The most likely tokens a row's filter is first worked out on (at least its top-k): a nucleus whose edge lies
among them needs no sort of the vocabulary."""


NUCLEUS_RTOL = 1e-6
"""Relative tolerance of the nucleus's edge: earlier mass within it of ``top_p`` counts as ``top_p``."""


def _nucleus_floor(
    values: torch.Tensor, weights: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The smallest value a nucleus keeps, from a row's values sorted in descending order ``[..., C]`` (its C most
    likely, or all), their weights (float32, as the caller computes them) and the row's total weight (float64):
    the last value whose strictly more likely tokens hold less than ``top_p`` of ``total``. NaN where the edge
    lies past the C values given (the caller looks further); -inf where ``top_p >= 1``."""
    # The first position whose strictly earlier tokens hold top_p of the mass is dropped, with everything after it,
    # unless it ties with the token before it: then that tie group is kept whole (its first token's earlier mass
    # is less) and the next group is the first dropped. Either way the floor is the value just before it.
    # Mass that reaches top_p to within NUCLEUS_RTOL counts as reaching it: the weights are float32, so an edge that
    # falls exactly on a token (0.5 + 0.3 of the mass at top_p 0.8) would otherwise be decided by rounding.
    mass = torch.cumsum(weights.double(), dim=-1)  # [..., C]: mass up to and including each
    threshold = (top_p.to(torch.float64) * total * (1.0 - NUCLEUS_RTOL))[..., None]
    edge = 1 + (mass[..., :-1] < threshold).sum(-1, keepdim=True)  # [..., 1]: first position dropped, C if none
    floor = values.gather(-1, edge - 1).squeeze(-1)
    floor = torch.where(edge.squeeze(-1) < values.shape[-1], floor, torch.nan)  # all kept: the edge may lie further
    return torch.where(top_p.to(floor.dtype) >= 1.0, -torch.inf, floor)


def candidate_width(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """How many of its most likely tokens a row's filter looks at first: ``max(top_k, CANDIDATES)`` ``[B]``."""
    return torch.clamp(torch.clamp(top_k, min=CANDIDATES), max=vocab)


SORT_WHOLE_ROWS = frozenset({"cuda"})
"""Device types on which a top-p filter sorts every row whole instead of searching its candidates first. The search
looks at the data to choose which rows to sort further (``nonzero``), which on a GPU makes the host wait for the
device several times a pass; a GPU sorts a batch of 151,936-token rows in well under a millisecond. On a CPU the
search is what makes top-p cheap (one row's sort costs more than its forward pass)."""


def sorts_whole_rows(tensor: torch.Tensor) -> bool:
    """Whether the filter sorts ``tensor``'s rows whole (:data:`SORT_WHOLE_ROWS`): no data-dependent step."""
    return tensor.device.type in SORT_WHOLE_ROWS


class Kept(NamedTuple):
    """:func:`kept_floor`'s answer."""

    floor: torch.Tensor
    """[B] the smallest value each row keeps (-inf: all)."""
    values: torch.Tensor
    """[B, C] each row's candidates, most likely first."""
    ids: torch.Tensor
    """[B, C] their token ids."""
    spilled: torch.Tensor | None = None
    """[S] the rows whose top-k kept set reaches past their candidates (ascending), when their weights were needed."""
    weights: torch.Tensor | None = None
    """[S, V] float32 ``exp`` of those rows' values, 0 below their top-k floor."""

    def kept_weights(self, rows: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        """The weights of ``rows`` (a subset of :attr:`spilled` when it is known) of ``scaled`` ``[B, V]`` over
        the tokens they keep, 0 elsewhere -> ``[len(rows), V]`` float32."""
        mine = scaled if len(rows) == len(scaled) else scaled[rows]
        if self.spilled is None or self.weights is None:
            weights = torch.exp(mine)
        else:
            weights = _among(self.spilled, rows, self.weights)
        return torch.where(mine >= self.floor[rows, None], weights, 0.0)


def kept_floor(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_top_k: int,
    any_top_p: bool,
    native: bool = True,
) -> Kept:
    """The one sampling filter as a floor: a row keeps every token whose temperature-scaled logit is at least its
    floor ``[B]`` (-inf: all). Top-k's floor is the k-th largest value; top-p's, on what top-k kept, the last value
    whose strictly more likely tokens hold less than ``top_p`` of the mass. Ties at either cut are kept, so the
    kept set depends on the values alone, never on an index order or on the other rows of the batch.

    Worked out on each row's ``candidate_width`` most likely tokens; a nucleus reaching past them is looked for over
    the whole row (:func:`nucleus_by_digits`: the floor the sorted row gives, without a sort; no dearer than a look
    at the 1,024 most likely, which an earlier version took first). Where :func:`sorts_whole_rows`, every row is
    sorted whole at once (the same floor, without a step that depends on the data). Also returns the candidates
    (values and ids ``[B, C]``, most likely first), and the weights over the vocabulary of the rows whose kept tokens
    reach past them (:class:`Kept`).

    A top-p filter's rows without top-k, float32 on a CPU where the kernel runs (and ``native``), take their floor
    from :func:`native_nucleus` instead: the same floor (tested), and no candidates (``[B, 0]``) for any row. A top-k
    row's nucleus lies among its k candidates, which this search finds for less than a pass over the row.
    """
    if native and any_top_p and not sorts_whole_rows(scaled) and on_kernel(scaled):
        plain = (top_k <= 0).nonzero().flatten()
        if len(plain):
            floor = torch.empty(len(scaled), dtype=torch.float32)
            every = len(plain) == len(scaled)
            floor[plain] = native_nucleus(scaled if every else scaled[plain], top_p if every else top_p[plain])[0]
            if not every:
                cut = (top_k > 0).nonzero().flatten()
                floor[cut] = kept_floor(
                    scaled[cut], top_k[cut], top_p[cut], max_top_k=max_top_k, any_top_p=True, native=False
                ).floor
            nothing = scaled[:, :0]
            return Kept(floor, nothing, torch.zeros_like(nothing, dtype=torch.int64))
    batch, vocab = scaled.shape
    own = candidate_width(top_k, vocab)
    width = min(vocab, max(max_top_k, CANDIDATES))
    values, ids = torch.topk(scaled, width, dim=-1)  # [B, C], sorted
    floor = torch.full((batch,), -torch.inf, device=scaled.device)
    if max_top_k:
        kth = values.gather(1, (torch.clamp(top_k, min=1, max=width) - 1)[:, None]).squeeze(1)
        floor = torch.where(top_k > 0, kth, floor)
    if not any_top_p:
        return Kept(floor, values, ids)
    if sorts_whole_rows(scaled):
        return Kept(torch.maximum(floor, _sorted_nucleus(scaled, floor, None, top_p)), values, ids)
    given, weights = _head(values, own, floor)
    total = weights.sum(-1, dtype=torch.float64)
    last = values.gather(1, (own - 1)[:, None]).squeeze(1)
    spill = (last >= floor).nonzero().flatten()  # rows whose kept tokens reach past their candidates
    whole: torch.Tensor | None = None
    whole_weights: torch.Tensor | None = None
    if len(spill):  # their kept mass, over the whole row
        whole = scaled if len(spill) == batch else scaled[spill]
        if max_top_k:
            whole = torch.where(whole >= floor[spill, None], whole, -torch.inf)
        whole_weights = torch.exp(whole)
        total[spill] = row_sum(whole_weights, torch.float64)
    nucleus = _nucleus_floor(given, weights, total, top_p)
    nucleus = torch.where(torch.isnan(nucleus) & (own >= vocab), -torch.inf, nucleus)  # a small vocabulary: all
    deeper = torch.isnan(nucleus).nonzero().flatten()  # rows whose nucleus reaches past their candidates
    if len(deeper):
        assert whole is not None and whole_weights is not None  # such a row spilled: its whole row is at hand
        searched = torch.isfinite(values[deeper, 0]) & (values[deeper, 0] <= 0)  # values as apply_temperature's
        if bool(searched.all()):
            mine, mine_weights = (_among(spill, deeper, x) for x in (whole, whole_weights))
            nucleus[deeper] = nucleus_by_digits(mine, mine_weights, total[deeper], top_p[deeper])
        else:  # NaN, or a caller's values above 0: the row sorted whole
            nucleus[deeper] = _sorted_nucleus(scaled[deeper], floor[deeper], total[deeper], top_p[deeper])
    return Kept(torch.maximum(floor, nucleus), values, ids, spill, whole_weights)


def native_nucleus(
    scaled: torch.Tensor, top_p: torch.Tensor, *, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kept_floor`'s top-p floor ``[B]`` for rows without top-k, through the kernel
    (:func:`ead_llm.core.kernels.nucleus`: :func:`nucleus_by_digits`'s search, one pass per digit), and with ``u``
    ``[B, 1]`` a token per row ``[B]`` drawn by inverse CDF in token-id order over its kept tokens (the sampler's
    draw; the weights are the kernel's ``exp``). A row the kernel leaves (a NaN in it) gets the torch search's floor
    and token ``-1`` (the caller draws it its own way). A 151,936-token row with most of it in the nucleus: 0.55 ms for
    the floor and the draw, against 6.5 ms for torch's floor alone (one thread, 64 rows)."""
    found, tokens = kernels.nucleus(scaled, top_p, NUCLEUS_RTOL, None if u is None else u.reshape(len(scaled)))
    odd = torch.isnan(found).nonzero().flatten()
    if len(odd):
        none = torch.zeros(len(odd), dtype=torch.int64)
        found[odd] = kept_floor(scaled[odd], none, top_p[odd], max_top_k=0, any_top_p=True, native=False).floor
    return found, tokens


def _among(spilled: torch.Tensor, rows: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The rows of ``tensor`` (one per row of ``spilled``, ascending) that belong to ``rows`` (a subset of them)."""
    return tensor if len(rows) == len(spilled) else tensor[torch.searchsorted(spilled, rows)]


def _sorted_nucleus(
    rows: torch.Tensor, floor: torch.Tensor, total: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """The nucleus floor of ``rows`` ``[R, V]`` read off the rows sorted whole, over their values at or above
    ``floor``, against ``total`` (None: the sorted weights' own sum); -inf where nothing is dropped."""
    given, weights = _head(sorted_descending(rows), torch.full_like(floor, rows.shape[-1], dtype=torch.int64), floor)
    edge = _nucleus_floor(given, weights, row_sum(weights, torch.float64) if total is None else total, top_p)
    return torch.where(torch.isnan(edge), -torch.inf, edge)


DIGITS = ((18, 13), (9, 9), (0, 9))
""":func:`nucleus_by_digits`'s passes over a float32's 31 magnitude bits: (shift, width) of each digit, highest
first (the first over every value: 13 bits, the exponent and 5 bits of mantissa, leave few values sharing one)."""


def nucleus_by_digits(
    given: torch.Tensor, weights: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The nucleus floor of rows of values at most 0 ``given`` ``[R, V]`` (-inf where dropped already) and their
    ``weights`` (float32 ``exp(given)``) without sorting them: the value v whose strictly larger values weigh less
    than ``top_p`` of ``total`` while those at or above it reach it (as :func:`_nucleus_floor` finds it in a sorted
    row, to within float64 rounding of the sums). A value at most 0 orders by its magnitude bits, largest value
    first, so the search reads them a digit at a time (:data:`DIGITS`): a weighted histogram per row of the digit,
    over the values that share the digits found so far, the cumulative mass finding the next digit. A pass over the
    row and two over the few values left, instead of a sort."""
    count, vocab, device = *given.shape, given.device
    threshold = top_p.to(torch.float64) * total * (1.0 - NUCLEUS_RTOL)
    before = torch.zeros(count, dtype=torch.float64, device=device)  # mass of the values above the prefix
    prefix = torch.zeros(count, dtype=torch.int64, device=device)  # the digits found so far
    (shift, width), *lower = DIGITS
    offsets = torch.arange(count, device=device, dtype=torch.int32)[:, None] << width
    slots = (given.view(torch.int32) >> shift).bitwise_and_((1 << width) - 1).add_(offsets).view(-1)
    before, prefix = _next_digit(slots, weights.reshape(-1).to(torch.float64), width, before, prefix, threshold)
    target = prefix.to(torch.int32)[:, None] + offsets
    inside = (slots.view(count, vocab) == target).view(-1).nonzero().squeeze(1)  # the values sharing the digit
    row = torch.div(inside, vocab, rounding_mode="floor")
    keys = (given.view(torch.int32).reshape(-1).index_select(0, inside) & 0x7FFFFFFF).to(torch.int64)
    mass = weights.reshape(-1).index_select(0, inside).to(torch.float64)
    for shift, width in lower:
        if shift != lower[0][0]:
            inside = ((keys >> (shift + width)) == prefix[row]).nonzero().squeeze(1)
            row, keys, mass = row[inside], keys[inside], mass[inside]
        slots = (row << width) | ((keys >> shift) & ((1 << width) - 1))
        before, prefix = _next_digit(slots, mass, width, before, prefix, threshold)
    return -prefix.to(torch.int32).view(torch.float32)


def _next_digit(
    slots: torch.Tensor,
    mass: torch.Tensor,
    width: int,
    before: torch.Tensor,
    prefix: torch.Tensor,
    threshold: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One digit of :func:`nucleus_by_digits`: from each value's slot (its row's ``2**width`` digits, its own) and
    float64 weight, the first digit at which a row's mass, counted from ``before``, reaches its ``threshold``; returns
    the mass before that digit and the prefix extended by it."""
    count = len(before)
    hist = torch.bincount(slots, weights=mass, minlength=count << width).view(count, 1 << width)
    cum = torch.cumsum(hist, dim=-1)
    first = (before[:, None] + cum < threshold[:, None]).sum(-1)  # the first digit whose mass reaches it
    last = (hist > 0).to(torch.int64).cumsum(-1).argmax(-1)  # a sum rounded below it: the last with mass
    first = torch.minimum(first, last)
    below = cum.gather(1, (first - 1).clamp(min=0)[:, None]).squeeze(1)
    return before + torch.where(first > 0, below, 0.0), (prefix << width) | first


def sorted_descending(rows: torch.Tensor) -> torch.Tensor:
    """Each row of ``rows`` ``[B, V]`` sorted, largest first (values only). On the CPU through numpy's vectorised
    sort, 30x faster than ``torch.sort`` over a 151,936-token row (which also orders indices nobody reads); the same
    values in the same order either way (NaN first, as ``torch.sort`` puts it)."""
    if rows.device.type != "cpu" or rows.dtype not in (torch.float32, torch.float64):
        return torch.sort(rows, dim=-1, descending=True).values
    return torch.from_numpy(np.sort(rows.detach().numpy(), axis=-1)).flip(-1)


def _head(values: torch.Tensor, width: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first ``width`` sorted ``values`` at or above its ``floor`` (the rest -inf), and their weights."""
    mine = torch.arange(values.shape[-1], device=values.device)[None, :] < width[:, None]
    given = torch.where(mine & (values >= floor[:, None]), values, -torch.inf)
    return given, torch.exp(given)


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_top_k: int,
    any_top_p: bool,
) -> torch.Tensor:
    """The one sampling filter applied: temperature, then :func:`kept_floor` (top-k, then top-p on what top-k
    left, ties at each cut kept). ``logits``: [B, V] raw; ``temperature`` [B] (> 0), ``top_p`` [B] float; ``top_k``
    [B] int (0: off), at most ``max_top_k``; ``any_top_p``: whether a row's ``top_p`` is below 1. Returns [B, V]
    float32 scaled logits, -inf outside each row's kept set. The sampler, the drafts, speculative verification
    and the recovery draw all go through it, so a token is drawable by one exactly when the others give it
    probability above zero."""
    scaled = apply_temperature(logits, temperature[:, None])
    if not max_top_k and not any_top_p:
        return scaled
    floor = kept_floor(scaled, top_k, top_p, max_top_k=max_top_k, any_top_p=any_top_p).floor
    return scaled.masked_fill(scaled < floor[:, None], -torch.inf)


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_top_k: int,
    any_top_p: bool,
) -> torch.Tensor:
    """The sampling distributions ``[B, V]`` of :func:`filter_logits` (same arguments)."""
    return torch.softmax(
        filter_logits(logits, temperature, top_k, top_p, max_top_k=max_top_k, any_top_p=any_top_p), dim=-1
    )


def best(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token along the last dimension, the lowest id among equal maxima (greedy's rule; a NaN
    counts as the maximum), as ``torch.argmax``. Float32 rows on a CPU go through the kernel (:func:`on_kernel`), the
    rows with a NaN or +inf through ``torch.max`` over a dimension, which keeps the same rule (documented) in about a
    third of ``argmax``'s time."""
    if not on_kernel(logits):
        return logits.max(dim=-1).indices
    return _row_stats(logits, entropy=False)[1]


def top_two(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The most and second most likely token of each row of ``logits`` ``[B, V]`` -> two ``[B]``, the lower id
    first among equal values (greedy's rule; ``torch.topk`` leaves the order of ties unspecified)."""
    first = best(logits)  # [B]
    second = best(logits.scatter(-1, first[:, None], -torch.inf))
    return first, second


def top_k_entropy_nats(logits: torch.Tensor, k: int = 20) -> torch.Tensor:
    """Entropy in nats of the top-``k`` probabilities of ``softmax(logits)``, renormalised (EAGER's measure).
    ``-inf`` logits (tokens a grammar forbids) count as probability 0."""
    top = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1).values
    p = torch.softmax(top, dim=-1)
    return -torch.special.xlogy(p, p).sum(dim=-1)
