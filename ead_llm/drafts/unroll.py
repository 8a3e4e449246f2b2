"""Training-time test (HASS, arXiv 2408.15766; EAGLE-3, arXiv 2503.01840): the draft run on its own guesses.

A feature-reading draft writes the ``j``-th token of a round (``j`` from 0) at position ``p`` reading its own
output at ``p - 1`` (its guess of the target's feature there) where ``j > 0``. Its attention then sees the
positions up to ``p - j`` as it read them with the target's features, and its own ``j`` earlier positions of the
round as it wrote them. Teacher forcing (every position reading the target's feature) trains only ``j = 0``;
measured on the SmolLM2 draft shipped before it (teacher forced), 65% of its first drafts stood and a third of
the later ones.

:func:`unrolled` runs ``depth`` such passes over whole sequences at once: pass ``j`` reads pass ``j - 1``'s outputs
one position back, and attends to pass 0's keys up to ``p - j`` and to pass ``i``'s key at ``p - j + i`` for
``1 <= i <= j`` (:func:`window_mask`). Pass ``j`` at ``p`` is then what the draft computes as its ``j``-th token
of a round that started at ``p - j``, for every ``p`` at once. Training needs these only over each answer (the
window ``distill`` passes): the prompt's positions are read, not computed on, by all but pass 0's keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ead_llm.drafts.model import FeatureDraft, previous


def window_mask(positions: torch.Tensor, length: int, j: int) -> torch.Tensor:
    """``[B, 1, A, length + j * A]`` booleans: may pass ``j``'s query at ``positions[b, a]`` (a window of each row,
    consecutive) read a key. Keys are ordered pass by pass: pass 0's at every position ``q`` of the row, read where
    ``q <= p - j``; pass ``i``'s (``1 <= i <= j``) at the window's, read at window index ``a - j + i`` only."""
    width = positions.shape[1]
    first = torch.arange(length, device=positions.device)[None, None, :] <= positions[:, :, None] - j
    a = torch.arange(width, device=positions.device)
    later = [(a[None, :] == a[:, None] - j + i)[None].expand(len(positions), -1, -1) for i in range(1, j + 1)]
    return torch.cat([first, *later], dim=-1)[:, None]


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, heads, T, d] at the positions ``cos``/``sin`` [B, T, d] were made for."""
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def unrolled(
    draft: FeatureDraft,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    depth: int,
    starts: torch.Tensor | None = None,
    width: int | None = None,
) -> list[torch.Tensor]:
    """``input_ids`` [B, T]; ``features`` [B, T, H] as :meth:`FeatureDraft.draft_forward` reads them. Returns, for
    each pass ``j < depth``, the draft's outputs (pass 0's are ``draft_forward``'s; ``draft.head`` of an output
    gives its logits, left to the caller, who needs them at few positions).

    The outputs are [B, T, H] over every position, or, with ``starts`` [B] and ``width``, [B, width, H] at
    positions ``starts[b] .. starts[b] + width - 1`` of each row (the window a loss reads; past a row's end they
    are meaningless). Pass 0 still reads every position (its keys and values, and every layer but the last), but
    the last layer's queries and MLP, and every later pass, run over the window alone: the positions before it
    only feed rounds that start before the window (``starts`` at an answer's first predicting position: the
    prompt's, which no loss counts)."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    batch, length = input_ids.shape
    device = input_ids.device
    if starts is None:
        starts, width = torch.zeros(batch, dtype=torch.long, device=device), length
    elif width is None or width < 1:
        raise ValueError(f"a window needs a width of at least 1, got {width}")
    positions = starts[:, None] + torch.arange(width, device=device)[None]
    rows = torch.arange(batch, device=device)[:, None]
    taken = positions.clamp(max=length - 1)  # a window running past the row reads its last position there
    everywhere = torch.arange(length, device=device)[None].expand(batch, length)
    embedded = draft.embed_tokens(input_ids)
    in_window = embedded[rows, taken]  # what every pass after the first reads with its guesses
    last = len(draft.layers) - 1
    causal = window_mask(everywhere, length, 0) if last else None  # pass 0's layers before the last
    keys: list[list[torch.Tensor]] = [[] for _ in draft.layers]
    values: list[list[torch.Tensor]] = [[] for _ in draft.layers]
    outs: list[torch.Tensor] = []
    dtype = draft.fc.weight.dtype
    x = draft.fc(torch.cat((embedded, features.to(dtype)), dim=-1))
    cos, sin = draft.rotary_emb(x, everywhere)
    win_cos, win_sin = draft.rotary_emb(x, positions)
    for j in range(depth):
        window = window_mask(positions, length, j)  # what the window's queries read in this pass, every layer
        if j:
            reading = previous(outs[-1])  # pass j reads pass j - 1's output one position back, in the window
            x = draft.fc(torch.cat((in_window, reading.to(dtype)), dim=-1))
        for n, layer in enumerate(draft.layers):
            attn: Any = layer.self_attn
            h = layer.input_layernorm(x)  # type: ignore[operator]
            shape = (batch, h.shape[1], -1, attn.head_dim)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            mask = window
            if j == 0 and n < last:  # every position, for the next layer's keys
                assert causal is not None
                q = _rotated(attn.q_proj(h).view(shape).transpose(1, 2), cos, sin)
                k, mask = _rotated(k, cos, sin), causal
            elif j == 0:  # the last layer: keys everywhere, queries in the window
                k = _rotated(k, cos, sin)
                x, h = x[rows, taken], h[rows, taken]
                q = _rotated(attn.q_proj(h).view(batch, width, -1, attn.head_dim).transpose(1, 2), win_cos, win_sin)
            else:
                q = _rotated(attn.q_proj(h).view(shape).transpose(1, 2), win_cos, win_sin)
                k = _rotated(k, win_cos, win_sin)
            keys[n].append(k)
            values[n].append(v)
            o = F.scaled_dot_product_attention(
                q,
                torch.cat(keys[n], dim=2),
                torch.cat(values[n], dim=2),
                attn_mask=mask,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, q.shape[2], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))  # type: ignore[operator]
        outs.append(draft.norm(x))
    return outs
