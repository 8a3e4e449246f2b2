"""The lean Llama forward's own arithmetic: the same bits as transformers' modules."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ead_llm.core.fused_llama import rotary, signed_sin


def test_rotary_on_q_and_k_together_is_transformers_bit_for_bit() -> None:
    """q and k rotated as one tensor, with the sign folded into sin and the halves swapped by a roll, equal
    transformers' ``apply_rotary_pos_emb`` exactly (greedy texts must not change), on the strided view of the
    projection's output the forward hands it."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, tokens, dim = 6, 2, 5, 16
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(1, tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        angles = torch.randn(1, tokens, dim // 2, generator=gen).repeat(1, 1, 2) * 3
        cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]  # [1, 1, T, D]
        qk = qkv[..., : (heads + kv_heads) * dim].view(1, tokens, heads + kv_heads, dim).transpose(1, 2)
        ours = rotary(qk, cos, signed_sin(sin))
        q, k = qk[:, :heads], qk[:, heads:]
        want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
        assert torch.equal(ours[:, :heads], want_q) and torch.equal(ours[:, heads:], want_k)
