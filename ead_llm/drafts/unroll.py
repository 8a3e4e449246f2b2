"""Training-time test (HASS, arXiv 2408.15766; EAGLE-3, arXiv 2503.01840): the draft run on its own guesses.

A feature-reading draft writes the ``j``-th token of a round (``j`` from 0) at position ``p`` reading its own
output at ``p - 1`` (its guess of the target's feature there) where ``j > 0``. Its attention then sees the
positions up to ``p - j`` as it read them with the target's features, and its own ``j`` earlier positions of the
round as it wrote them. Teacher forcing (every position reading the target's feature) trains only ``j = 0``;
measured on the SmolLM2 draft shipped before it (teacher forced), 65% of its first drafts stood and a third of
the later ones.

:func:`unrolled` runs ``depth`` such passes over whole sequences at once: pass ``j`` reads pass ``j - 1``'s outputs
one position back, and attends to pass 0's keys up to ``p - j`` and to pass ``i``'s key at ``p - j + i`` for
``1 <= i <= j`` (:func:`unroll_mask`). Pass ``j`` at ``p`` is then what the draft computes as its ``j``-th token of
a round that started at ``p - j``, for every ``p`` at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ead_llm.drafts.model import FeatureDraft, previous


def unroll_mask(length: int, depth: int) -> torch.Tensor:
    """``[depth, length, depth * length]`` booleans: may pass ``j``'s query at ``p`` read pass ``i``'s key at ``q``
    (keys ordered pass by pass). Pass ``j`` reads pass 0 at ``q <= p - j`` and pass ``i`` (``1 <= i <= j``) at
    ``q = p - j + i`` only."""
    j = torch.arange(depth)[:, None, None]
    p = torch.arange(length)[None, :, None]
    i = torch.arange(depth).repeat_interleave(length)[None, None, :]
    q = torch.arange(length).repeat(depth)[None, None, :]
    first = (i == 0) & (q <= p - j)
    later = (i >= 1) & (i <= j) & (q == p - j + i)
    return first | later


def unrolled(draft: FeatureDraft, input_ids: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """``input_ids`` [B, T]; ``features`` [B, T, H] as :meth:`FeatureDraft.draft_forward` reads them. Returns, for
    each pass ``j < depth``, the draft's outputs [B, T, H] (pass 0's are ``draft_forward``'s; ``draft.head`` of an
    output gives its logits, left to the caller, who needs them at few positions)."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device)[None].expand(batch, length)
    embedded = draft.embed_tokens(input_ids)
    mask = unroll_mask(length, depth).to(input_ids.device)
    keys: list[list[torch.Tensor]] = [[] for _ in draft.layers]
    values: list[list[torch.Tensor]] = [[] for _ in draft.layers]
    outs = []
    reading = features.to(draft.fc.weight.dtype)
    for j in range(depth):
        x = draft.fc(torch.cat((embedded, reading), dim=-1))
        cos, sin = draft.rotary_emb(x, positions)
        for n, layer in enumerate(draft.layers):
            attn: Any = layer.self_attn
            h = layer.input_layernorm(x)  # type: ignore[operator]
            shape = (batch, length, -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[n].append(k)
            values[n].append(v)
            o = F.scaled_dot_product_attention(
                q,
                torch.cat(keys[n], dim=2),
                torch.cat(values[n], dim=2),
                attn_mask=mask[j, :, : (j + 1) * length],
                enable_gqa=q.shape[1] != k.shape[1],
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, length, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))  # type: ignore[operator]
        out = draft.norm(x)
        outs.append(out)
        reading = previous(out)
    return outs
