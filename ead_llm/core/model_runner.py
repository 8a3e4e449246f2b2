"""The model runner: one packed forward pass of one model over the rows of a step.

Every row's unseen tokens (one for a decode, several for a prefill or a catch-up after a switch,
the drafts for a verification) are concatenated into one sequence ``[1, T]`` with their true
position ids, so the projections and MLPs run on real tokens only, decode and catch-up rows
together. Attention is the only part that needs each row's history: the model's attention layers
call :func:`paged_attention` (registered with transformers' ``AttentionInterface``), which writes
the pass's new keys and values into the paged :class:`~ead_llm.core.kv_cache.KVCache` and attends
each row over its own positions: a prompt's positions block by block, each block over the keys up to its end
(:class:`PromptAttention`: the same bits with or without a prefix-cache hit); each short decode row's query
batched with those of the same padded length (:data:`BUCKET`), a
row alone in its call read over a view of its blocks where they lie in order (the cache keeps room for that);
long decode rows, and rows feeding several tokens (a verification, a catch-up), alone, their history cut at fixed
positions (:data:`SPLIT`), each piece read over a view where its blocks lie in order, else copied. Each row's
attention runs over shapes that depend on that row alone, so its logits are the same bits whatever other rows share
the pass and wherever its blocks lie. With exact verification (:data:`AS_DECODE_MAX`) a verification's or
catch-up's tokens are each attended as a one-token decode step would be, so its logits are a decode step's bits.
The model's head runs only at the positions someone reads (``logits_to_keep``), so a 2,000-token prefill returns
one row of logits, not 2,000.

Llama-family models (Llama, Mistral, Qwen2) run through a lean forward of their own weights
(:mod:`ead_llm.core.fused_llama`) that calls the same paged attention; other models through
their transformers modules.

A pass that raises (out of memory, or a fault one row triggers) is bisected: each half is run
again, down to single rows; a row that fails alone is reported with its error and the others
succeed. Rows are safe to re-run: keys are written at true positions and a cache's length moves
only when its pass succeeds.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ead_llm.core import kernels
from ead_llm.core.fused_draft import FusedDraft, reads_features
from ead_llm.core.fused_llama import FusedLlama
from ead_llm.core.fused_llama import supports as supports_fused
from ead_llm.core.kv_cache import KVCache, SequenceKV
from ead_llm.core.loading import LoadedModel
from ead_llm.core.transfer import upload
from ead_llm.core.types import ForwardWork, Role, quick_init

logger = logging.getLogger(__name__)

ATTENTION = "ead_paged"
"""The attention implementation the engine's models run under: :func:`paged_attention` for the
engine's packed passes, transformers' SDPA for any other call (``model.generate`` still works)."""


@dataclass(frozen=True)
class AttentionGroup:
    """Entries of a pass attended together, each ``W`` consecutive queries over its row's keys padded to the same
    length ``L``: short decode rows (``W`` 1), short rows feeding ``W`` tokens together, or the queries of one row
    under exact verification, each as a decode step at its position (``W`` 1, the row's keys read once, over a view
    where its blocks lie in order, and shared by them). Several rows' keys are copied into one batch; a row alone
    whose blocks lie in order is read over a view."""

    query_index: torch.Tensor | None
    """[B, W] packed index of each entry's queries; None when the group holds every query of the pass, in packed
    order."""
    key_slots: torch.Tensor | None
    """[B, L] flat KV slot of each entry's positions 0..L-1 (past its end: its row's last position), or [1, L] when
    the entries share one row's keys; None with ``span``."""
    mask: torch.Tensor
    """[B, 1, W, L] in the cache's dtype: 0 where a query sees a position (its own and those before), -inf elsewhere
    (built once for all layers; a bool mask is converted in every call)."""
    span: slice | None = None
    """For queries of one row whose blocks lie in order: the flat slots of its padded positions, read over a view
    (past its end: the rest of its own last block, zeroed when handed out; masked)."""


@dataclass(frozen=True)
class Queries:
    """A short row's consecutive new tokens attended in a group: one for a decode step (or a token of an exact
    verification, attended as a decode step at its position would be), or all of a row's when they attend together
    under one mask (batched with rows of the same padded length feeding as many)."""

    index: int
    """The first one's packed position."""
    end: int
    """Positions the first one sees, its own included (each next one sees one more)."""
    width: int = 1
    own: int | None = None
    """A sibling's flat slot, where its own keys lie instead of at position ``end - 1``."""


VIEW_MIN = 512
"""Positions from which a row is attended alone, in pieces read over views where they lie in order; below it, rows
are batched with those of the same padded length and width, which costs less than one call each (measured when
decode rows were batched whatever their length, against 128, one thread, A/B in one process, median of 3: the
embedded pair's rows of up to 500 positions ran 0-9% faster at 2-4 rows, 9-14% at 16, 15-23% at 64; 4 SmolLM2 chat
rows of up to 290 positions 6% faster, the same tokens)."""

BUCKET = 16
"""A short row's keys are padded (masked) to the next multiple of this many positions, and rows are batched only with
rows padded to the same length and feeding as many tokens: the attention kernel's sums then run over shapes that
depend on the row alone, so its logits are the same bits whatever rows share its pass. (The kernel's arithmetic on
one batch entry does not depend on the others; its vector tails and matrix-product blocking depend on the length and
the number of queries.) The default block size, so that a row alone in its call is read over a view of its own
blocks (zeroed when handed out) without a copy; with smaller blocks, only where its blocks reach that far."""

AS_DECODE_MAX = 32
"""Under :attr:`ModelRunner.exact_verification` every token past a row's prompt (:attr:`PassRow.prompt`), and a row's
tokens over a history (its siblings counted) when it feeds up to this many (a prompt's last positions after a
cached prefix, a row whose prompt is not said), attends as a one-token decode step at its position would: one
query over the row's keys padded as a decode pads them, its sums in a decode's order. A verification's logits are
then a decode step's to the last bit, and greedy speculative decoding is LargeOnly's whatever the near-ties. The
queries of one row share its keys (one view, or one copy, for all of them), but the CPU's attention kernel costs
about 7 us more per query than with the row's queries in one call: on the embedded pair (one thread, A/B against
the default, twice), speculative decoding at gamma 4 ran 2-5% slower one request at a time and 19-23% at 16 rows,
EAD 3-7% (on SmolLM2 0-6%: the engine turns it on by default from
:data:`~ead_llm.core.frontend.EXACT_MIN_PARAMETERS`). Off, a row's new tokens (past one) attend together, as a
prefill's do (a short row's batched with rows of its padded length feeding as many), and round differently from a
decode step in the last bits."""

SPLIT = 2048
"""A row attended alone is split at every multiple of this many positions: each piece is read over a view where its
blocks lie in order, else copied, and the pieces are merged in position order. The split points depend on the row
alone, not on where its blocks lie, so neither does its arithmetic. Measured on SmolLM2 (4 rows of 1,100 positions,
one thread, `benchmarks/long_context.py`): at 512 a decode step took 7 ms more than one view per row (the merge);
at 2,048 the same as one view, and a row over a cached prefix (its blocks in two runs) copies its one piece: its
step about 2 ms slower than with caching off, where merging its runs was about even."""


@dataclass(frozen=True)
class RowAttention:
    """One row attended alone over its history in fixed pieces (views where they lie in order, else copies)."""

    queries: slice
    """Packed positions of its new tokens (then its siblings)."""
    pieces: tuple[slice | torch.Tensor, ...]
    """Flat cache slots of its positions 0..end, one entry per :data:`SPLIT` positions: a range (read over a view)
    or the slots themselves (copied)."""
    mask: torch.Tensor | None
    """[1, 1, W, L] bool for several new tokens (each sees the positions up to its own) or siblings."""


@dataclass(frozen=True)
class PromptAttention:
    """A row's prompt positions ``start..stop`` attended block by block (chunks of the cache's block size, on its
    grid): the queries of chunk ``[s, e)`` over the row's keys ``0..e`` read from the cache, each seeing those up to
    its own. A chunk's call depends on its positions and tokens alone, not on which of them this pass computes, so
    a prompt whose first blocks came from the prefix cache reads the same bits as one computed whole (one causal
    call would round its queries by how many it holds)."""

    queries: slice
    """Packed positions of its tokens ``start..stop``."""
    start: int
    keys: slice | torch.Tensor
    """Flat cache slots of positions ``0..stop``: a range where its blocks lie in order (a view), else the slots."""


ROWS_ALIKE_KEYS = (48, 496)
"""Key lengths :func:`rows_alike` probes: a short row's and one near :data:`VIEW_MIN`, the longest a grouped call
holds (how a kernel shares its work among threads may change with the key length; both are asked, not assumed)."""
_ROWS_ALIKE: dict[int, bool] = {}
"""By torch's thread count: whether the CPU's fused attention kernel gives a row alone the bits it gets beside
others (probed once per count)."""


def rows_alike(threads: int) -> bool:
    """Whether, at ``threads`` threads, the CPU's fused attention kernel gives a row (decode and few-token queries)
    the same bits alone as among others. Not so everywhere: on an AMD Zen 3 at 2 threads a decode row alone got other
    last bits than among 8 in every draw (at 1 thread the same; the Intel Xeon of earlier sessions passed the
    2-thread batch-invariance tests), so a prompt's text would follow its batch."""
    if threads not in _ROWS_ALIKE:
        gen = torch.Generator().manual_seed(0)
        alike = True
        for width, length in itertools.product((1, 3), ROWS_ALIKE_KEYS):
            q, k, v = (torch.randn(8, 4, n, 24, generator=gen) for n in (width, length, length))
            together = _CPU_ATTENTION(q, k, v)[0]
            alike &= all(torch.equal(_CPU_ATTENTION(q[i : i + 1], k[i : i + 1], v[i : i + 1])[0], together[i : i + 1])
                         for i in (0, 5))  # fmt: skip
        _ROWS_ALIKE[threads] = alike
    return _ROWS_ALIKE[threads]


@contextlib.contextmanager
def row_invariant(device: torch.device) -> Iterator[None]:
    """Run the attention inside on one thread where more would give a row other bits beside other rows
    (:func:`rows_alike`): a row's numbers must not depend on its batch. Setting the count costs well under a
    microsecond; the one thread costs more. Calls that can hold several rows need it (short rows grouped by padded
    length); a row attended alone does not (a prompt, a long row, one with siblings): on the Zen 3 at 2 threads, a
    prefill of 4 rows of 1,100 tokens on SmolLM2 took 11.0 s with its attention on one thread and 8.9-9.1 s on
    both, of 3,000 tokens 44-51 against 37-39 s."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or rows_alike(threads):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    *,
    causal: bool = False,
    alone: bool = False,
) -> torch.Tensor:
    """SDPA ``[B, H, W, D]`` of queries ``[B, H, W, D]`` over keys and values ``[B, Hkv, L, D]`` (grouped-query
    attention read in place when ``Hkv < H``). ``alone``: the call holds one row attended alone, in a shape that
    row's own length and tokens decide whatever else runs (:class:`RowAttention`), so no thread count can make its
    bits follow other rows and it runs on every thread; otherwise under :func:`row_invariant`."""
    with contextlib.nullcontext() if alone else row_invariant(query.device):
        if query.shape[2] == 1 and key.shape[1] != query.shape[1]:  # decode, grouped (a mask is [B, 1, 1, L])
            folded = _folded(query, key.shape[1])
            out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
            return out.view(query.shape)
        grouped = key.shape[1] != query.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=grouped
        )


def split_attention(
    query: torch.Tensor,
    pieces: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """:func:`attention` of one row's queries ``[1, H, W, D]`` over keys and values that lie in several pieces
    ``[1, Hkv, L_i, D]`` (in position order), without joining them: the scores against every piece are
    normalised together, then each piece's values are weighted and summed. ``mask``: ``[1, 1, W, L]``."""
    _, heads, width, dim = query.shape
    kv_heads = pieces[0][0].shape[1]
    if width == 1 and mask is None and query.device.type == "cpu":
        return _merged_decode(_folded(query, kv_heads), pieces, scaling).view(query.shape)
    q = query[0].reshape(kv_heads, heads // kv_heads * width, dim)  # query heads h = kv * group + g
    scores = torch.cat([q @ keys[0].transpose(1, 2) for keys, _ in pieces], dim=-1).float()
    scores *= dim**-0.5 if scaling is None else scaling
    if mask is not None:
        scores.masked_fill_(~mask[0, 0].repeat(heads // kv_heads, 1), float("-inf"))
    weights = scores.softmax(dim=-1).to(query.dtype)
    out = None
    at = 0
    for _, values in pieces:
        length = values.shape[2]
        part = weights[:, :, at : at + length] @ values[0]
        out = part if out is None else out.add_(part)
        at += length
    assert out is not None
    return out.view(1, heads, width, dim)


def _folded(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Decode queries ``[B, H, 1, D]`` as ``[B, Hkv, H / Hkv, D]``: each group's queries as the rows of its key-value
    head (a view; query head h = kv * group + g), so grouped attention runs as plain attention, keys read in place."""
    batch, heads, _, dim = query.shape
    return query.view(batch, kv_heads, heads // kv_heads, dim)


def _merged_decode(
    folded: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]], scaling: float | None
) -> torch.Tensor:
    """:func:`split_attention` of one row's :func:`_folded` decode queries ``[1, Hkv, G, D]`` on the CPU (same shape
    out): the fused attention kernel over each piece in place, its outputs weighted by the share of the softmax
    mass each piece holds (from the log-sum-exp the kernel returns), as FlashAttention's split-KV decoding merges
    its splits."""
    parts = [_CPU_ATTENTION(folded, keys, values, scale=scaling) for keys, values in pieces]  # one row: any threads
    shares = torch.stack([lse for _, lse in parts]).softmax(dim=0)  # [S, 1, Hkv, G], float32
    out = None
    for (part, _), share in zip(parts, shares, strict=True):
        weighted = part.float() * share.unsqueeze(-1)  # [1, Hkv, G, D]
        out = weighted if out is None else out.add_(weighted)
    assert out is not None
    return out.to(folded.dtype)


_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""The CPU's fused attention kernel: ``(output [B, H, W, D], logsumexp [B, H, W])``."""


class ChunkMasks:
    """The additive masks of :func:`prompt_attention`'s chunks, built once per chunk size, query heads per key head,
    dtype and device (and again, twice as long, when a longer prompt comes): ``chunk`` rows over ``length`` keys, row
    ``i`` open (0) up to key ``length - chunk + i`` and -inf after, repeated once per query head of a group."""

    def __init__(self) -> None:
        self._masks: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, chunk: int, groups: int, queries: int, keys: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``[groups * queries, keys]``: row ``g * queries + i`` (position ``keys - queries + i``) sees the keys up
        to its own; a view for a whole chunk."""
        name = (chunk, groups, dtype, device)
        full = self._masks.get(name)
        if full is None or full.shape[1] < keys:
            length = max(keys, 256, 0 if full is None else 2 * full.shape[1])
            columns = torch.arange(length, device=device)
            closed = columns[None] > columns[length - chunk :, None]
            full = torch.zeros(closed.shape, dtype=dtype, device=device).masked_fill_(closed, float("-inf"))
            full = self._masks[name] = full.repeat(groups, 1)
        length = full.shape[1]
        if queries == chunk:
            return full[:, length - keys :]
        return full[chunk - queries : chunk, length - keys :].repeat(groups, 1)


def prompt_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    chunk: int,
    masks: ChunkMasks,
    scaling: float | None,
) -> torch.Tensor:
    """:class:`PromptAttention`: ``[1, H, W, D]`` for one row's queries ``[1, H, W, D]`` at positions ``start..start
    + W`` over its keys and values ``[1, Hkv, start + W, D]``, one call per chunk of the grid. On the CPU a group's
    query heads are folded into one key head's rows (keys read once per key head, as in :func:`_folded`)."""
    _, heads, width, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    cpu = query.device.type == "cpu"
    out = torch.empty_like(query)
    begin = start
    while begin < start + width:
        end = min((begin // chunk + 1) * chunk, start + width)
        count = end - begin
        part = query[:, :, begin - start : end - start]
        mask = masks.get(chunk, groups if cpu else 1, count, end, query.dtype, query.device)
        seen = keys[:, :, :end], values[:, :, :end]
        if cpu:
            folded = part.reshape(1, kv_heads, groups * count, dim)
            got = _CPU_ATTENTION(folded, *seen, attn_mask=mask, scale=scaling)[0].reshape(1, heads, count, dim)
        else:
            got = attention(part, *seen, mask, scaling, alone=True)
        out[:, :, begin - start : end - start] = got
        begin = end
    return out


@dataclass(frozen=True)
class NativeQueries:
    """The queries of a pass that ead-llm's own attention kernel runs over the cache where it lies
    (:func:`ead_llm.core.kernels.attend`): every query past a row's prompt, each as a decode step at its position."""

    index: torch.Tensor | None
    """[N] their packed positions; None when they are every query of the pass, in order."""
    tables: torch.Tensor
    """Their rows' block tables, one after another (int64)."""
    meta: torch.Tensor
    """[N, 3] int64: where a query's row table starts in ``tables``, the positions it sees, a sibling's own slot or
    -1."""


@dataclass(frozen=True)
class PackedBatch:
    """What :func:`paged_attention` needs for one pass: where to write, what each row attends to."""

    cache: KVCache
    write_slots: torch.Tensor
    """[T] flat slot of each packed token."""
    groups: tuple[AttentionGroup, ...]
    counts: tuple[int, ...]
    """New tokens per row, in packed order."""
    starts: tuple[int, ...]
    """Position of each row's first new token."""
    blocks: tuple[list[int], ...]
    """Each row's block table, in packed order."""
    alone: tuple[RowAttention | PromptAttention, ...] = ()
    """Rows attended one by one (the others are in ``groups``)."""
    masks: ChunkMasks | None = None
    """The chunk masks of :class:`PromptAttention` rows."""
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Each group's keys and values, copied into the same storage for every layer (a fresh buffer per call costs a
    page-faulted allocation once it passes the allocator's mapping threshold)."""
    write_span: slice | None = None
    """``write_slots`` as a range where they are consecutive (one row's decode token, a prompt in ordered blocks):
    written as a slice, without an indexed scatter."""
    native: NativeQueries | None = None
    """The queries ead-llm's own attention kernel runs (the others are in ``groups`` and ``alone``)."""

    @property
    def length(self) -> int:
        """One past the last position any row reaches in this pass."""
        return max(start + count for start, count in zip(self.starts, self.counts, strict=True))

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a layer's new keys/values ``[1, H, T, D]``."""
        where = self.write_span if self.write_span is not None else self.write_slots
        self.cache.write(layer, where, keys[0].transpose(0, 1), values[0].transpose(0, 1))

    def attend(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention output ``[1, T, H, D]`` for packed queries ``[1, H, T, D]``."""
        layer = int(module.layer_idx)  # type: ignore[arg-type]
        native = self.native
        if native is not None and native.index is None:  # every query: the kernel's output as it is
            return self._attend_native(layer, query[0].transpose(0, 1), native, scaling)[None]
        if native is None and not self.groups and len(self.alone) == 1:  # one row: no copies, no scatter
            return self._attend_row(layer, self.alone[0], query, scaling).transpose(1, 2)
        if native is None and len(self.groups) == 1 and self.groups[0].query_index is None and not self.alone:
            group = self.groups[0]
            _, heads, tokens, dim = query.shape
            entries, width = group.mask.shape[0], group.mask.shape[2]  # B entries of W consecutive tokens each
            keys, values = self._keys(layer, 0, group, entries)
            rows_q = query[0].view(heads, entries, width, dim).transpose(0, 1)  # [B, H, W, D]
            out = attention(rows_q, keys, values, group.mask, scaling)
            return out.transpose(1, 2).reshape(1, tokens, heads, dim)
        q = query[0].transpose(0, 1)  # [T, H, D]
        out = torch.empty_like(q)
        for row in self.alone:
            out[row.queries] = self._attend_row(layer, row, query, scaling)[0].transpose(0, 1)
        for index, group in enumerate(self.groups):
            assert group.query_index is not None
            keys, values = self._keys(layer, index, group, group.query_index.shape[0])  # [B, Hkv, L, D]
            rows_q = q[group.query_index].transpose(1, 2)  # [B, H, W, D]
            out[group.query_index] = attention(rows_q, keys, values, group.mask, scaling).transpose(1, 2)
        if native is not None:
            assert native.index is not None
            out[native.index] = self._attend_native(layer, q[native.index], native, scaling)
        return out.unsqueeze(0)

    def _attend_native(
        self, layer: int, query: torch.Tensor, native: NativeQueries, scaling: float | None
    ) -> torch.Tensor:
        """``[N, H, D]``: ead-llm's attention kernel over queries ``[N, H, D]`` where the cache holds their keys."""
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        assert keys is not None and values is not None, "attention before any write"
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return kernels.attend(query, keys, values, native.tables, native.meta, self.cache.block_size, scale)

    def _attend_row(
        self, layer: int, row: RowAttention | PromptAttention, query: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """``[1, H, W, D]`` attention of one row's queries (``query``: the pass's ``[1, H, T, D]``)."""
        rows_q = query[:, :, row.queries]
        if isinstance(row, PromptAttention):
            assert self.masks is not None
            keys, values = (
                self.cache.view(layer, row.keys)
                if isinstance(row.keys, slice)
                else self.cache.gather(layer, row.keys[None])
            )
            return prompt_attention(rows_q, keys, values, row.start, self.cache.block_size, self.masks, scaling)
        pieces = [
            self.cache.view(layer, piece) if isinstance(piece, slice) else self.cache.gather(layer, piece[None])
            for piece in row.pieces
        ]
        if len(pieces) == 1:
            return attention(rows_q, *pieces[0], row.mask, scaling, alone=True)
        return split_attention(rows_q, pieces, row.mask, scaling)

    def _keys(self, layer: int, index: int, group: AttentionGroup, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``index``'s keys and values ``[B, Hkv, L, D]`` at ``layer`` for its ``queries`` (one row's read once
        for all of its queries: a view, or a copy in its scratch storage, repeated without copying)."""
        if group.span is not None:
            keys, values = self.cache.view(layer, group.span)
        else:
            assert group.key_slots is not None
            keys, values = self.cache.gather(layer, group.key_slots, self.scratch.get(index))
            self.scratch[index] = (keys, values)
        if keys.shape[0] != queries:
            keys, values = (tensor.expand(queries, *tensor.shape[1:]) for tensor in (keys, values))
        return keys, values

    def histories(self, layer: int) -> list[torch.Tensor]:
        """Each row's stored keys ``[L_r, H, D]`` (positions 0..end), in packed order; for test models."""
        keys = self.cache.keys[layer]
        assert keys is not None
        out = []
        for blocks, start, count in zip(self.blocks, self.starts, self.counts, strict=True):
            slots = self.cache.slots(blocks, range(start + count))
            out.append(keys[:, upload(slots, torch.long, keys.device)].transpose(0, 1))
        return out


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    ead_batch: PackedBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: the engine's packed pass when ``ead_batch`` is
    given, plain SDPA otherwise."""
    if ead_batch is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    ead_batch.write(int(module.layer_idx), key, value)  # type: ignore[arg-type]
    return ead_batch.attend(module, query, scaling), None


def tree_mask(start: int, end: int, drafts: int, siblings: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, W, L]`` bool: a row's new positions ``start..end`` each see the positions up to their own,
    and sibling ``d`` (the alternative to draft ``d``, the ``drafts`` being the row's last tokens; its keys at slot
    ``end + d``) sees the positions before its draft's and itself; ``W = end - start + siblings``, ``L = end +
    siblings``."""
    keys = torch.arange(end + siblings, device=device)[None, :]
    chain = keys <= torch.arange(start, end, device=device)[:, None]
    if not siblings:  # any row of several new tokens
        return chain[None, None]
    depth = torch.arange(siblings, device=device)[:, None]
    leaves = (keys < end - drafts + depth) | (keys == end + depth)
    return torch.cat((chain, leaves))[None, None]


def consecutive(slots: list[int]) -> slice | None:
    """``slots`` as a range when they are consecutive and increasing (:func:`in_order` checks their ends first: a
    pass's slots may span the whole cache), else None."""
    first = in_order(slots, len(slots))
    return None if first is None else slice(first, first + len(slots))


def in_order(blocks: list[int], used: int) -> int | None:
    """The first of a block table's ``used`` first blocks when they are consecutive, else None."""
    first = blocks[0]
    if blocks[used - 1] - first != used - 1 or blocks[:used] != list(range(first, first + used)):
        return None
    return first


def register_attention() -> None:
    """Make :data:`ATTENTION` a valid ``attn_implementation`` (idempotent); masks for other calls are SDPA's."""
    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@quick_init
@dataclass(frozen=True)
class PassRow:
    """One sequence in one pass: feed what the model has not seen, read the last ``read`` positions."""

    kv: SequenceKV
    tokens: Sequence[int]
    """The whole sequence so far; the model has seen ``kv.length`` of them."""
    read: int = 1
    """Positions whose next-token logits are needed, counted back from the end (1: the next token;
    a verification of g drafts reads g + 1)."""
    target: SequenceKV | None = None
    """The same sequence in the target's cache, for a draft that reads the target's hidden states."""
    siblings: tuple[int, ...] = ()
    """A verify row's :attr:`ead_llm.core.types.Read.siblings`: a token beside each of its first drafts (the last
    ``read - 1`` tokens), each fed at its draft's position over the tokens before it, its keys written to the slots
    after the row's end (reserved by the scheduler, rolled back after the verdict); the logits after each are read
    after the row's own. Read only where those slots are reserved (else none are, and :attr:`RunnerOutput.siblings`
    says so)."""
    prompt: int = 0
    """How many of its first tokens are its prompt (0: not said), attended block by block (:class:`PromptAttention`).
    Under exact verification, every later token (drafts, or what a preempted sequence had generated) is attended as
    a decode step, as they were computed the first time."""


@dataclass
class RunnerOutput:
    """Logits of every row that ran, and the error of every row that failed alone."""

    logits: torch.Tensor
    """[N, V] float32 logits of the read positions of the rows that ran."""
    start: dict[int, int] = field(default_factory=dict)
    """Row index -> its first row in ``logits`` (its reads follow, oldest first)."""
    reads: dict[int, int] = field(default_factory=dict)
    work: dict[int, ForwardWork] = field(default_factory=dict)
    failures: dict[int, BaseException] = field(default_factory=dict)
    siblings: dict[int, int] = field(default_factory=dict)
    """Row index -> siblings read for it (their logits follow its reads), for rows that asked for some."""

    def rows(self, row: int) -> torch.Tensor:
        """``[read, V]`` logits of one row."""
        return self.logits[self.start[row] : self.start[row] + self.reads[row]]

    def last_rows(self, rows: list[int]) -> torch.Tensor:
        """``[B, V]`` logits at the last read position of each of ``rows`` (no copy when that is all of them)."""
        index = [self.start[i] + self.reads[i] - 1 for i in rows]
        if index == list(range(self.logits.shape[0])):
            return self.logits
        return self.logits.index_select(0, upload(index, torch.long, self.logits.device))

    def padded_rows(self, rows: list[int], width: int) -> torch.Tensor:
        """``[R, width, V]`` logits of each of ``rows``' reads, its last one repeated past its end."""
        index = [[self.start[i] + min(j, self.reads[i] - 1) for j in range(width)] for i in rows]
        return self.logits[upload(index, torch.long, self.logits.device)]

    def sibling_rows(self, rows: list[int], width: int) -> tuple[torch.Tensor, list[int]] | None:
        """``[R, width, V]`` logits after each of ``rows``' siblings (a row's last read past its siblings), and how
        many each has; None when none of them has any."""
        counts = [self.siblings.get(i, 0) for i in rows]
        if not any(counts):
            return None
        index = [
            [self.start[i] + self.reads[i] + j if j < n else self.start[i] + self.reads[i] - 1 for j in range(width)]
            for i, n in zip(rows, counts, strict=True)
        ]
        return self.logits[upload(index, torch.long, self.logits.device)], counts


def check_full_attention(source: str, config: Any) -> None:
    """Refuse models with sliding-window or linear-attention layers: the paged cache keeps every
    position and a row attends to all its earlier ones, which those layers must not. A model-wide
    window at least ``max_position_embeddings`` long never slides (the engine keeps sequences within
    it), so such a model runs as full attention (Phi-3 mini 128k, Phi-3.5 mini); hybrid models (layer
    types other than full attention, as in Gemma 2/3) are refused whatever their window."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    limit = getattr(config, "max_position_embeddings", None)
    slides = bool(window) and not (limit and window >= limit)
    kinds = set(getattr(config, "layer_types", None) or [])
    unsupported = kinds - {"full_attention"}
    if unsupported:
        raise ValueError(
            f"{source}: layers of kind {sorted(unsupported)} are not supported "
            "(ead-llm's KV cache serves full-attention models only)"
        )
    if slides:
        raise ValueError(
            f"{source}: sliding-window attention ({window} of {limit} positions) is not supported "
            "(ead-llm serves full-attention models)"
        )


class ModelRunner:
    """Runs one model of the pair over the rows of a pass (see the module docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        device: torch.device,
        vocab_size: int,
        cache: KVCache,
        *,
        fused: bool = True,
        target_cache: KVCache | None = None,
        draft_bfloat16: bool | None = None,
    ) -> None:
        """``fused``: run Llama-family models through :mod:`ead_llm.core.fused_llama` (their q/k/v and
        gate/up weights become views of fused tensors); otherwise, and for other models, through
        transformers' modules with the paged attention. ``target_cache``: the target's cache, where a draft
        that reads the target's hidden states finds them (:mod:`ead_llm.core.fused_draft`); ``draft_bfloat16``:
        whether such a draft's products run in bfloat16 (:attr:`draft_bfloat16`; None: where it pays)."""
        self.role: Role = loaded.role
        self.model = loaded.model
        self.device = device
        self.vocab_size = vocab_size
        self.cache = cache
        self.retried_passes = 0
        self._retried_for: set[type[BaseException]] = set()
        check_full_attention(loaded.info.source, self.model.config)
        self.reads_features = reads_features(self.model)
        self._draft: FusedDraft | None = None
        self._target_cache = target_cache
        if self.reads_features:
            if target_cache is None:
                raise ValueError(
                    f"{loaded.info.source}: a draft that reads its target's hidden states needs the target"
                )
            self._draft = FusedDraft(self.model, bfloat16=draft_bfloat16)
        self._fused = FusedLlama(self.model) if fused and supports_fused(self.model) else None
        if self._fused is None and self._draft is None and not getattr(self.model, "handles_ead_batch", False):
            if not getattr(self.model, "_supports_attention_backend", False):
                raise ValueError(
                    f"{loaded.info.source}: {type(self.model).__name__} does not take transformers' attention "
                    "interface, which ead-llm's paged KV cache needs; use a model family that does (Llama, "
                    "Qwen2, Mistral, GPT-2, ...)"
                )
            register_attention()
            self.model.set_attn_implementation(ATTENTION)
        self._no_mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device)
        self._block_offsets = torch.arange(cache.block_size, device=device)
        self._edges = torch.zeros(0, device=device)
        self._chunk_masks = ChunkMasks()
        self.exact_verification = False
        """Whether a row's tokens past a one-token decode each attend as a decode step would (:data:`AS_DECODE_MAX`);
        off, only one-token rows do."""
        fused = self._fused is not None or self._draft is not None
        self.native_attention = (
            fused
            and self.device.type == "cpu"
            and all(p.dtype == torch.float32 for p in self.model.parameters())
            and kernels.available()
        )
        """Whether every query past a row's prompt runs through ead-llm's own attention kernel, as a decode step at
        its position, over the cache where it lies (:func:`ead_llm.core.kernels.attend`): where the kernel builds, for
        the fused float32 models, whose layers hand it their queries (prompts keep torch's fused attention, block by
        block)."""

    @property
    def draft_bfloat16(self) -> bool:
        """Whether this runner's model is a draft reading its target's hidden states whose products run in
        bfloat16 (:meth:`ead_llm.core.fused_draft.FusedDraft.use_bfloat16`)."""
        return self._draft is not None and self._draft.bfloat16

    @draft_bfloat16.setter
    def draft_bfloat16(self, on: bool) -> None:
        if self._draft is not None:
            self._draft.use_bfloat16(on)

    def draft_bfloat16_possible(self) -> bool:
        """Whether :attr:`draft_bfloat16` could be on here, asked without changing the draft's kernels
        (:meth:`ead_llm.core.fused_draft.FusedDraft.bfloat16_possible`)."""
        return self._draft is not None and self._draft.bfloat16_possible()

    def keep_features(self, source: str) -> None:
        """Store every position's final hidden state in the cache, for a draft that reads them."""
        if self._fused is None:
            raise ValueError(
                f"{source}: a draft that reads its target's hidden states needs a Llama-family target "
                "(Llama, Mistral, Qwen2, SmolLM); use an ordinary small model with this one"
            )
        self._fused.keep_features = True

    def execute(self, rows: Sequence[PassRow]) -> RunnerOutput:
        """Run ``rows`` in one pass (bisecting on failure); advance each successful row's cache length."""
        chunks: list[tuple[list[int], torch.Tensor, list[int]]] = []
        failures: dict[int, BaseException] = {}
        self._execute(rows, list(range(len(rows))), chunks, failures)
        logits = (
            chunks[0][1] if len(chunks) == 1 else self._empty() if not chunks else torch.cat([c for _, c, _ in chunks])
        )
        out = RunnerOutput(logits=logits, failures=failures)
        at = 0
        for indices, _, siblings in chunks:
            for i, extra in zip(indices, siblings, strict=True):
                row = rows[i]
                start, new = row.kv.length, len(row.tokens) - row.kv.length
                out.start[i], out.reads[i] = at, row.read
                if row.siblings:
                    out.siblings[i] = extra
                recomputed = max(0, min(start + new, row.kv.evicted) - start)
                out.work[i] = ForwardWork(self.role, new + extra, start, recomputed)  # a sibling is work too
                row.kv.length += new
                if row.kv.length >= row.kv.evicted:
                    row.kv.evicted = 0  # all it lost is back
                at += row.read + extra
        return out

    def _execute(
        self,
        rows: Sequence[PassRow],
        indices: list[int],
        chunks: list[tuple[list[int], torch.Tensor, list[int]]],
        failures: dict[int, BaseException],
    ) -> None:
        try:
            chunks.append((indices, *self._run([rows[i] for i in indices])))
        except Exception as exc:
            if len(indices) == 1:
                failures[indices[0]] = exc
                return
            self.retried_passes += 1
            if type(exc) not in self._retried_for:  # bisecting hides a fault of every pass (its halves succeed)
                self._retried_for.add(type(exc))
                logger.warning(
                    "a %s-model pass of %d rows failed (%s: %s); running it again in halves (logged once per kind "
                    "of error; engine.faults counts the retries)",
                    self.role.value,
                    len(indices),
                    type(exc).__name__,
                    exc,
                )
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(indices) // 2
            self._execute(rows, indices[:half], chunks, failures)
            self._execute(rows, indices[half:], chunks, failures)

    def _empty(self) -> torch.Tensor:
        return torch.empty((0, self.vocab_size), device=self.device)

    def _run(self, rows: Sequence[PassRow]) -> tuple[torch.Tensor, list[int]]:
        """One packed pass; logits ``[N, V]`` (float32) of the read positions, rows in ``rows`` order (each row's
        reads, then its siblings'), and the siblings read for each row."""
        batch, ids, positions, keep, order, siblings = self._pack(rows)
        if self._draft is not None:
            features = self._features([rows[i] for i in order], ids.shape[0])
            return self._draft(ids, positions, keep, batch, features)[:, : self.vocab_size].float(), siblings
        if self._fused is not None:
            return self._fused(ids, positions, keep, batch)[:, : self.vocab_size].float(), siblings
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=self._no_mask,
            logits_to_keep=keep,
            use_cache=False,
            ead_batch=batch,
        )
        return out.logits[0, :, : self.vocab_size].float(), siblings

    def _features(self, ordered: list[PassRow], tokens: int) -> torch.Tensor:
        """``[T, hidden]``: the feature each packed token reads (rows in packed order): zeros for a token of the
        row's prompt (:attr:`PassRow.prompt`), whatever the target holds there, so that a prompt's keys depend on its
        tokens alone and a cached prompt block holds what computing it would (with prefix caching the target may hold
        a prompt's first blocks already); past the prompt, its predecessor's in the target's cache where the target
        has run there, else the draft's own from an earlier pass, else zeros."""
        assert self._draft is not None and self._target_cache is not None
        size = self.cache.block_size
        theirs: tuple[list[int], list[int]] = ([], [])  # (packed index, target slot)
        mine: tuple[list[int], list[int]] = ([], [])  # (packed index, own slot)
        at = 0
        for row in ordered:
            start, end = row.kv.length, len(row.tokens)
            seen = row.target.length if row.target is not None else 0
            for p in range(max(start, 1, row.prompt), end):
                q = p - 1
                if q < seen:
                    assert row.target is not None
                    theirs[0].append(at + p - start)
                    theirs[1].append(row.target.blocks[q // size] * size + q % size)
                elif q < start:
                    mine[0].append(at + p - start)
                    mine[1].append(row.kv.blocks[q // size] * size + q % size)
            at += end - start
        out = torch.zeros((tokens, self._draft.hidden), dtype=self._draft.fc.weight.dtype, device=self.device)
        for (index, slots), cache in ((theirs, self._target_cache), (mine, self.cache)):
            if index:
                where = upload([index, slots], torch.long, self.device)
                out[where[0]] = cache.read_features(where[1]).to(out.dtype)
        return out

    def _pack(
        self, rows: Sequence[PassRow]
    ) -> tuple[PackedBatch, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
        """The packed batch: decode rows first, then multi-token rows (each followed by its siblings); the inputs in
        that order, the packed indices of the read positions in ``rows`` order (a row's siblings' after its reads),
        the rows' indices in packed order, and the siblings read for each row. One loop over the rows, O(1) per
        decode row (this runs every pass, on the thread that launches the forward)."""
        decode_rows: list[int] = []
        multi_rows: list[int] = []
        for i, row in enumerate(rows):
            new = len(row.tokens) - row.kv.length
            if new <= 0:
                raise RuntimeError("the runner was asked for logits with no new token to feed")
            if not 1 <= row.read <= new:
                raise RuntimeError(f"a row reads {row.read} positions but feeds {new}")
            if len(row.siblings) >= row.read:
                raise RuntimeError(f"a row has {len(row.siblings)} siblings for {row.read - 1} drafts")
            (decode_rows if new == 1 else multi_rows).append(i)
        order = decode_rows + multi_rows  # decode rows first, each part in the rows' order
        size = self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ordered: list[PassRow] = []
        offsets: list[int] = []  # packed offset of each ordered row
        counts: list[int] = []
        alone: list[RowAttention | PromptAttention] = []
        gathered: dict[tuple[int, int, int], list[tuple[PassRow, Queries]]] = {}  # (padded length, width, owner)
        native: list[int] = []  # packed index of each query the attention kernel runs
        meta: list[int] = []  # its row table's offset in tables, positions seen, own slot (NativeQueries.meta)
        tables: list[int] = []
        ends = [0] * len(rows)  # packed end of each row's own tokens, in rows order
        siblings = [0] * len(rows)  # siblings read for each row, in rows order
        at = 0
        for b, i in enumerate(order):
            row = rows[i]
            tokens, start, blocks = row.tokens, row.kv.length, row.kv.blocks
            end = len(tokens)
            count = end - start
            ordered.append(row)
            offsets.append(at)
            counts.append(count)
            # a multi-token row's first block when its blocks up to ``end`` lie in order (slots in a range)
            first = in_order(blocks, self.cache.blocks_for(end)) if count > 1 else None
            extra = 0  # siblings: their keys after the row's end, in slots the scheduler reserved
            reach = end + len(row.siblings)
            if row.siblings and start and self._draft is None and len(blocks) >= self.cache.blocks_for(reach):
                extra = len(row.siblings)
            if count == 1:
                ids.append(tokens[start])
                positions.append(start)
                slots.append(blocks[start // size] * size + start % size)
            else:
                ids.extend(tokens[start:])
                positions.extend(range(start, end))
                if first is not None:
                    slots.extend(range(first * size + start, first * size + end))
                else:
                    slots.extend(self.cache.slots(blocks, range(start, end)))
            if extra:  # sibling d at draft d's position, its keys at slot end + d
                drafts = row.read - 1
                ids.extend(row.siblings)
                positions.extend(range(end - drafts, end - drafts + extra))
                slots.extend(self.cache.slots(blocks, range(end, end + extra)))
            if count == 1 and start >= max(1, row.prompt) and self.native_attention:  # a decode row, past its prompt
                native.append(at)
                meta.extend((len(tables), end, -1))
                tables.extend(blocks)
                ends[i], siblings[i] = at + 1, 0
                at += 1
                continue
            table = -1
            for unit in self._plan(row, at, count, extra):
                if isinstance(unit, (RowAttention, PromptAttention)):
                    alone.append(unit)
                elif self.native_attention:  # each query as a decode step, over the row's table
                    if table < 0:
                        table = len(tables)
                        tables.extend(blocks)
                    for j in range(unit.width):  # (a sibling's own keys stand in for its draft's position)
                        native.append(unit.index + j)
                        own = -1 if unit.own is None else unit.own
                        meta.extend((table, unit.end + j - (own >= 0), own))
                elif unit.end >= VIEW_MIN:  # (one query: rows of several that long attend together, in pieces)
                    pieces = self._pieces(blocks, unit.end, unit.own)
                    alone.append(RowAttention(slice(unit.index, unit.index + 1), pieces, None))
                else:  # one row's exact queries share its keys; decode rows and rows of several share groups
                    owner = -1 if count == 1 or unit.width > 1 else b if unit.own is None else -2 - unit.index
                    key = (-(-(unit.end + unit.width - 1) // BUCKET) * BUCKET, unit.width, owner)
                    gathered.setdefault(key, []).append((row, unit))
            ends[i] = at + count
            siblings[i] = extra
            at += count + extra
        inputs = upload([ids, positions, slots], torch.long, self.device)  # [3, T]
        every = not alone and len(gathered) == 1 and len(ids) == sum(q.width for _, q in next(iter(gathered.values())))
        groups = [self._group(part, length, width, whole=every) for (length, width, _), part in gathered.items()]
        batch = PackedBatch(
            cache=self.cache,
            write_slots=inputs[2],
            write_span=consecutive(slots),
            groups=tuple(groups),
            counts=tuple(counts),
            starts=tuple(row.kv.length for row in ordered),
            blocks=tuple(row.kv.blocks for row in ordered),
            alone=tuple(alone),
            masks=self._chunk_masks,
            native=None
            if not native
            else NativeQueries(
                index=None if len(native) == len(ids) else upload(native, torch.long, self.device),
                tables=upload(tables, torch.long, self.device),
                meta=upload(meta, torch.long, self.device),
            ),
        )
        if not multi_rows:  # a decode pass: one read per row (1 <= read <= new, checked above)
            keep = [end - 1 for end in ends]
        else:
            keep = []
            for row, end, extra in zip(rows, ends, siblings, strict=True):
                keep.extend(range(end - row.read, end + extra))
        return batch, inputs[0], inputs[1], upload(keep, torch.long, self.device), order, siblings

    def _plan(
        self, row: PassRow, offset: int, count: int, extra: int
    ) -> list[RowAttention | PromptAttention | Queries]:
        """How ``row`` (whose ``count`` new tokens start at packed ``offset``, then its ``extra`` siblings) is
        attended: its prompt's positions block by block (:class:`PromptAttention`); each later one as a decode step
        at its position: a decode step's token, every token after a history with its siblings under
        :attr:`native_attention`, and under :attr:`exact_verification` every token past the prompt
        (:attr:`PassRow.prompt`) and up to :data:`AS_DECODE_MAX` tokens after a history (or drafts after a prompt)
        with their siblings; else a short row's several tokens together (grouped), a long row's, or a row's with
        siblings, together over its history in pieces of :data:`SPLIT` positions."""
        start = row.kv.length
        end = start + count
        drafts = row.read - 1  # a verification's drafts are the row's last tokens
        exact = self.exact_verification
        if row.prompt:
            stop = min(end, max(start, row.prompt))
        else:  # not said: a first pass's tokens are its prompt, but for drafts attended as decode steps
            stop = end - (drafts if exact and 0 < drafts <= AS_DECODE_MAX else 0) if start == 0 else start
        units: list[RowAttention | PromptAttention | Queries] = []
        if stop > start:
            keys = self._span(row.kv.blocks, 0, stop)
            units.append(PromptAttention(slice(offset, offset + stop - start), start, keys))
            offset, start, count = offset + stop - start, stop, end - stop
            if not count:
                return units
        as_decode = exact and (count + extra <= AS_DECODE_MAX or start >= row.prompt > 0)
        if count + extra == 1 or as_decode or self.native_attention:
            units += [Queries(offset + j, start + j + 1) for j in range(count)]
            if extra:  # sibling d at draft d's position, its keys at slot end + d
                slots = self.cache.slots(row.kv.blocks, range(end, end + extra))
                units += [Queries(offset + count + d, end - drafts + d + 1, own=slots[d]) for d in range(extra)]
            return units
        if not extra and end < VIEW_MIN:
            return [*units, Queries(offset, start + 1, width=count)]
        # each new token sees the positions up to its own (and each sibling those before its draft's, and itself)
        mask = tree_mask(start, end, drafts, extra, self.device)
        pieces = self._pieces(row.kv.blocks, end + extra)
        return [*units, RowAttention(slice(offset, offset + count + extra), pieces, mask)]

    def _span(self, blocks: list[int], begin: int, stop: int) -> slice | torch.Tensor:
        """The flat slots of positions ``begin..stop`` of a row with this block table: a range where their blocks lie
        in order, else the slots themselves."""
        size = self.cache.block_size
        first = begin // size
        if in_order(blocks[first:], self.cache.blocks_for(stop) - first) is not None:
            base = (blocks[first] - first) * size
            return slice(base + begin, base + stop)
        return upload(self.cache.slots(blocks, range(begin, stop)), torch.long, self.device)

    def _pieces(self, blocks: list[int], reach: int, own: int | None = None) -> tuple[slice | torch.Tensor, ...]:
        """The flat slots of positions ``0..reach`` of a row with this block table, cut at every multiple of
        :data:`SPLIT` (:meth:`_span`). ``own``: the slot read for position ``reach - 1`` instead of its own (a
        sibling's keys)."""
        out: list[slice | torch.Tensor] = []
        for begin in range(0, reach, SPLIT):
            stop = min(begin + SPLIT, reach)
            if own is not None and stop == reach:  # the last piece ends with the sibling's keys
                out.append(upload([*self.cache.slots(blocks, range(begin, stop - 1)), own], torch.long, self.device))
            else:
                out.append(self._span(blocks, begin, stop))
        return tuple(out)

    def _mask_dtype(self) -> torch.dtype:
        """The cache's dtype (an additive mask in the queries' dtype runs on every SDPA backend)."""
        keys = self.cache.keys[0]
        return torch.float32 if keys is None else keys.dtype

    def _decode_mask(self, end: int, length: int) -> torch.Tensor:
        """``[1, 1, 1, length]`` float: 0 before ``end``, -inf from it (a view of one kept row, the same numbers
        :meth:`_group` builds)."""
        dtype = self._mask_dtype()
        if self._edges.shape[0] < 2 * length or self._edges.dtype != dtype:
            size = max(2 * length, 2 * self._edges.shape[0])
            self._edges = torch.zeros(size, dtype=dtype, device=self.device)
            self._edges[size // 2 :] = float("-inf")
        middle = self._edges.shape[0] // 2
        return self._edges[middle - end : middle - end + length].view(1, 1, 1, length)

    def _group(self, part: list[tuple[PassRow, Queries]], length: int, width: int, *, whole: bool) -> AttentionGroup:
        """The attention of ``part``'s queries (``width`` each), their rows' keys padded to ``length`` positions: short
        decode rows, rows feeding ``width`` tokens together, or one row's exact queries (which share its keys);
        ``whole``: they are every query of the pass."""
        device, size = self.device, self.cache.block_size
        b = len(part)
        row = part[0][0]
        shared = b == 1 or part[1][0] is row  # one row's queries: its keys read once for all
        used = self.cache.blocks_for(length)
        first = in_order(row.kv.blocks, used) if shared and len(row.kv.blocks) >= used else None
        mine = part[0][1].own
        span = None if first is None or mine is not None else slice(first * size, first * size + length)
        ends = [query.end for _, query in part]
        if span is not None and whole and b == 1 and width == 1:  # one decode row (batch 1's every step)
            return AttentionGroup(None, None, self._decode_mask(ends[0], length), span)
        owners = [row] if shared else [r for r, _ in part]
        tables = (
            [] if span is not None else [r.kv.blocks[:used] + [0] * (used - len(r.kv.blocks[:used])) for r in owners]
        )
        # one copy to the device for the group's numbers, tables flattened after them
        index = [query.index for _, query in part]
        numbers = upload([*ends, *index, *(k for table in tables for k in table)], torch.long, device)
        steps = torch.arange(width, device=device)
        seen = numbers[:b, None] - 1 + steps  # [B, W]: the last position each query sees
        positions = torch.arange(length, device=device)
        hidden = positions > seen[:, :, None]  # [B, W, L]
        mask = torch.zeros(hidden.shape, dtype=self._mask_dtype(), device=device).masked_fill_(hidden, -torch.inf)
        mask = mask[:, None]
        query_index = None if whole else numbers[b : 2 * b, None] + steps
        if span is not None:
            return AttentionGroup(query_index, None, mask, span)
        table = numbers[2 * b :].view(len(owners), used)
        # each row reads its own slots only: positions past its end repeat its last one (masked, but another
        # sequence's values there could be anything, and 0 * NaN is NaN)
        last = seen[:, -1:].max(dim=0, keepdim=True).values if shared else seen[:, -1:]
        own = torch.minimum(positions, last).expand(len(owners), -1)
        key_slots = (table[:, :, None] * size + self._block_offsets).view(len(owners), -1).gather(1, own)
        if mine is not None:  # a sibling (alone in its group): its own keys at its position
            key_slots[0, ends[0] - 1] = mine
        return AttentionGroup(query_index, key_slots, mask)
