"""The model runner: one packed forward pass of one model over the rows of a step.

Every row's unseen tokens (one for a decode, several for a prefill or a catch-up after a switch,
the drafts for a verification) are concatenated into one sequence ``[1, T]`` with their true
position ids, so the projections and MLPs run on real tokens only, decode and catch-up rows
together. Attention is the only part that needs each row's history: the model's attention layers
call :func:`paged_attention` (registered with transformers' ``AttentionInterface``), which writes
the pass's new keys and values into the paged :class:`~ead_llm.core.kv_cache.KVCache` and attends
each row over its own positions, decode rows in one ``[B, H, 1, L]`` call and multi-token rows in a
second. The model's head runs only at the positions someone reads (``logits_to_keep``), so a
2,000-token prefill returns one row of logits, not 2,000.

Llama-family models (Llama, Mistral, Qwen2) run through a lean forward of their own weights
(:mod:`ead_llm.core.fused_llama`) that calls the same paged attention; other models through
their transformers modules.

A pass that raises (out of memory, or a fault one row triggers) is bisected: each half is run
again, down to single rows; a row that fails alone is reported with its error and the others
succeed. Rows are safe to re-run: keys are written at true positions and a cache's length moves
only when its pass succeeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ead_llm.core.fused_llama import FusedLlama
from ead_llm.core.fused_llama import supports as supports_fused
from ead_llm.core.kv_cache import KVCache, SequenceKV
from ead_llm.core.loading import LoadedModel
from ead_llm.core.types import ForwardWork, Role

ATTENTION = "ead_paged"
"""The attention implementation the engine's models run under: :func:`paged_attention` for the
engine's packed passes, transformers' SDPA for any other call (``model.generate`` still works)."""


@dataclass(frozen=True)
class AttentionGroup:
    """Rows of a pass attended together: decode rows (one new token each), or multi-token rows."""

    query_index: torch.Tensor | None
    """[B, W] packed index of each row's w-th new token (past a row's end: its last token); None when the
    group is one row holding the whole pass, in order."""
    key_slots: torch.Tensor | None
    """[B, L] flat KV slot of each row's positions 0..L-1 (past a row's end: its last position)."""
    span: slice | None
    """Instead of ``key_slots``, for one row whose blocks lie in order: its positions' flat slots."""
    mask: torch.Tensor | None
    """[B, 1, W, L] bool, True where a query may attend; None when every query sees all L positions."""
    real: tuple[torch.Tensor, torch.Tensor] | None
    """For W > 1: (row, column) of every real query, in packed order; None for decode rows."""
    packed: torch.Tensor | None
    """[R] packed indices of the real queries (same order as ``real``); None with ``query_index``."""


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

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a layer's new keys/values ``[1, H, T, D]``."""
        self.cache.write(layer, self.write_slots, keys[0].transpose(0, 1), values[0].transpose(0, 1))

    def attend(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention output ``[1, T, H, D]`` for packed queries ``[1, H, T, D]``."""
        layer = int(module.layer_idx)  # type: ignore[arg-type]
        if len(self.groups) == 1 and self.groups[0].query_index is None:  # one row: no gathers at all
            group = self.groups[0]
            keys, values = self._keys(layer, group)
            return sdpa_attention_forward(module, query, keys, values, group.mask, scaling=scaling)[0]
        q = query[0].transpose(0, 1)  # [T, H, D]
        out = torch.empty_like(q)
        for group in self.groups:
            keys, values = self._keys(layer, group)  # [B, Hkv, L, D]
            assert group.query_index is not None and group.packed is not None
            rows_q = q[group.query_index].transpose(1, 2)  # [B, H, W, D]
            attended, _ = sdpa_attention_forward(module, rows_q, keys, values, group.mask, scaling=scaling)
            # attended: [B, W, H, D]
            if group.real is None:
                out[group.packed] = attended[:, 0]
            else:
                out[group.packed] = attended[group.real]
        return out.unsqueeze(0)

    def _keys(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        if group.span is not None:
            return self.cache.view(layer, group.span)
        assert group.key_slots is not None
        return self.cache.gather(layer, group.key_slots)

    def histories(self, layer: int) -> list[torch.Tensor]:
        """Each row's stored keys ``[L_r, H, D]`` (positions 0..end), in packed order; for test models."""
        keys = self.cache.keys[layer]
        assert keys is not None
        size = self.cache.block_size
        out = []
        for blocks, start, count in zip(self.blocks, self.starts, self.counts, strict=True):
            slots = [blocks[p // size] * size + p % size for p in range(start + count)]
            out.append(keys[torch.tensor(slots, dtype=torch.long, device=keys.device)])
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


def register_attention() -> None:
    """Make :data:`ATTENTION` a valid ``attn_implementation`` (idempotent); masks for other calls are SDPA's."""
    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@dataclass(frozen=True)
class PassRow:
    """One sequence in one pass: feed what the model has not seen, read the last ``read`` positions."""

    kv: SequenceKV
    tokens: Sequence[int]
    """The whole sequence so far; the model has seen ``kv.length`` of them."""
    read: int = 1
    """Positions whose next-token logits are needed, counted back from the end (1: the next token;
    a verification of g drafts reads g + 1)."""


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

    def rows(self, row: int) -> torch.Tensor:
        """``[read, V]`` logits of one row."""
        return self.logits[self.start[row] : self.start[row] + self.reads[row]]

    def last_rows(self, rows: list[int]) -> torch.Tensor:
        """``[B, V]`` logits at the last read position of each of ``rows`` (no copy when that is all of them)."""
        index = [self.start[i] + self.reads[i] - 1 for i in rows]
        if index == list(range(self.logits.shape[0])):
            return self.logits
        return self.logits.index_select(0, torch.tensor(index, device=self.logits.device))

    def padded_rows(self, rows: list[int], width: int) -> torch.Tensor:
        """``[R, width, V]`` logits of each of ``rows``' reads, its last one repeated past its end."""
        index = [[self.start[i] + min(j, self.reads[i] - 1) for j in range(width)] for i in rows]
        return self.logits[torch.tensor(index, device=self.logits.device)]


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
    ) -> None:
        """``fused``: run Llama-family models through :mod:`ead_llm.core.fused_llama` (their q/k/v and
        gate/up weights become views of fused tensors); otherwise, and for other models, through
        transformers' modules with the paged attention."""
        self.role: Role = loaded.role
        self.model = loaded.model
        self.device = device
        self.vocab_size = vocab_size
        self.cache = cache
        self.retried_passes = 0
        check_full_attention(loaded.info.source, self.model.config)
        self._fused = FusedLlama(self.model) if fused and supports_fused(self.model) else None
        if self._fused is None and not getattr(self.model, "handles_ead_batch", False):
            if not getattr(self.model, "_supports_attention_backend", False):
                raise ValueError(
                    f"{loaded.info.source}: {type(self.model).__name__} does not take transformers' attention "
                    "interface, which ead-llm's paged KV cache needs; use a model family that does (Llama, "
                    "Qwen2, Mistral, GPT-2, ...)"
                )
            register_attention()
            self.model.set_attn_implementation(ATTENTION)
        self._no_mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device)

    def execute(self, rows: Sequence[PassRow]) -> RunnerOutput:
        """Run ``rows`` in one pass (bisecting on failure); advance each successful row's cache length."""
        chunks: list[tuple[list[int], torch.Tensor]] = []
        failures: dict[int, BaseException] = {}
        self._execute(rows, list(range(len(rows))), chunks, failures)
        logits = (
            chunks[0][1] if len(chunks) == 1 else self._empty() if not chunks else torch.cat([c for _, c in chunks])
        )
        out = RunnerOutput(logits=logits, failures=failures)
        at = 0
        for indices, _ in chunks:
            for i in indices:
                row = rows[i]
                start, new = row.kv.length, len(row.tokens) - row.kv.length
                out.start[i], out.reads[i] = at, row.read
                recomputed = max(0, min(start + new, row.kv.evicted) - start)
                out.work[i] = ForwardWork(self.role, new, start, recomputed)
                row.kv.length += new
                if row.kv.length >= row.kv.evicted:
                    row.kv.evicted = 0  # all it lost is back
                at += row.read
        return out

    def _execute(
        self,
        rows: Sequence[PassRow],
        indices: list[int],
        chunks: list[tuple[list[int], torch.Tensor]],
        failures: dict[int, BaseException],
    ) -> None:
        try:
            chunks.append((indices, self._run([rows[i] for i in indices])))
        except Exception as exc:
            if len(indices) == 1:
                failures[indices[0]] = exc
                return
            self.retried_passes += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(indices) // 2
            self._execute(rows, indices[:half], chunks, failures)
            self._execute(rows, indices[half:], chunks, failures)

    def _empty(self) -> torch.Tensor:
        return torch.empty((0, self.vocab_size), device=self.device)

    def _run(self, rows: Sequence[PassRow]) -> torch.Tensor:
        """One packed pass; logits ``[N, V]`` (float32) of the read positions, rows in ``rows`` order."""
        batch, ids, positions, keep = self._pack(rows)
        if self._fused is not None:
            return self._fused(ids, positions, keep, batch)[:, : self.vocab_size].float()
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=self._no_mask,
            logits_to_keep=keep,
            use_cache=False,
            ead_batch=batch,
        )
        return out.logits[0, :, : self.vocab_size].float()

    def _pack(self, rows: Sequence[PassRow]) -> tuple[PackedBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed batch: decode rows first, then multi-token rows; the inputs in that order, and the
        packed indices of the read positions in ``rows`` order."""
        news = [len(row.tokens) - row.kv.length for row in rows]
        for row, new in zip(rows, news, strict=True):
            if new <= 0:
                raise RuntimeError("the runner was asked for logits with no new token to feed")
            if not 1 <= row.read <= new:
                raise RuntimeError(f"a row reads {row.read} positions but feeds {new}")
        order = sorted(range(len(rows)), key=lambda i: news[i] > 1)  # decode rows first (stable)
        size = self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0]
        for i in order:
            row = rows[i]
            start, blocks = row.kv.length, row.kv.blocks
            ids.extend(row.tokens[start:])
            span = range(start, len(row.tokens))
            positions.extend(span)
            slots.extend(blocks[p // size] * size + p % size for p in span)
            offsets.append(len(ids))
        inputs = torch.tensor([ids, positions, slots], dtype=torch.long, device=self.device)  # [3, T]
        ordered = [rows[i] for i in order]
        decode = sum(1 for i in order if news[i] == 1)
        groups = []
        if decode:
            groups.append(self._group(ordered[:decode], offsets[: decode + 1], whole=decode == len(order) == 1))
        if decode < len(order):
            groups.append(self._group(ordered[decode:], offsets[decode:], whole=len(order) == 1))
        batch = PackedBatch(
            cache=self.cache,
            write_slots=inputs[2],
            groups=tuple(groups),
            counts=tuple(news[i] for i in order),
            starts=tuple(rows[i].kv.length for i in order),
            blocks=tuple(rows[i].kv.blocks for i in order),
        )
        where = {i: b for b, i in enumerate(order)}
        keep: list[int] = []
        for i, row in enumerate(rows):
            end = offsets[where[i] + 1]
            keep.extend(range(end - row.read, end))
        return batch, inputs[0], inputs[1], torch.tensor(keep, dtype=torch.long, device=self.device)

    def _group(self, rows: list[PassRow], offsets: list[int], *, whole: bool) -> AttentionGroup:
        """The attention of ``rows`` (whose packed tokens start at ``offsets``); ``whole``: they are the
        only row of the pass."""
        device, size = self.device, self.cache.block_size
        counts = [offsets[b + 1] - offsets[b] for b in range(len(rows))]
        starts = [row.kv.length for row in rows]
        ends = [s + c for s, c in zip(starts, counts, strict=True)]
        width, length = max(counts), max(ends)
        span = key_slots = None
        first = rows[0].kv.blocks[0] if len(rows) == 1 else -1
        used = -(-length // size)
        if len(rows) == 1 and rows[0].kv.blocks[:used] == list(range(first, first + used)):
            span = slice(first * size, first * size + length)  # one row in consecutive blocks: a view
        else:
            tables = torch.tensor(
                [row.kv.blocks[:used] + [0] * (used - len(row.kv.blocks[:used])) for row in rows],
                dtype=torch.long,
                device=device,
            )  # [B, M]
            end = torch.tensor(ends, dtype=torch.long, device=device)
            positions = torch.arange(length, device=device)
            key_slots = self.cache.slots(tables, torch.minimum(positions[None, :], end[:, None] - 1))  # [B, L]
        if width == 1:
            mask = None
            if min(ends) < length:  # some rows are shorter: hide the positions past their end
                end = torch.tensor(ends, dtype=torch.long, device=device)
                mask = (torch.arange(length, device=device)[None, :] < end[:, None])[:, None, None, :]
            if whole:
                return AttentionGroup(None, key_slots, span, mask, None, None)
            index = torch.tensor(offsets[:-1], dtype=torch.long, device=device)
            return AttentionGroup(index[:, None], key_slots, span, mask, None, index)
        count = torch.tensor(counts, dtype=torch.long, device=device)  # [B]
        cols = torch.arange(width, device=device)
        last = torch.minimum(cols[None, :], count[:, None] - 1)  # [B, W]
        query_pos = torch.tensor(starts, dtype=torch.long, device=device)[:, None] + last  # [B, W]
        keys = torch.arange(length, device=device)
        mask = (keys[None, None, :] <= query_pos[:, :, None])[:, None]  # [B, 1, W, L]: causal, true positions
        if whole:
            return AttentionGroup(None, key_slots, span, mask, None, None)
        offset = torch.tensor(offsets[:-1], dtype=torch.long, device=device)
        query_index = offset[:, None] + last  # [B, W]
        real_rows, real_cols = torch.nonzero(cols[None, :] < count[:, None], as_tuple=True)
        return AttentionGroup(
            query_index, key_slots, span, mask, (real_rows, real_cols), query_index[real_rows, real_cols]
        )
