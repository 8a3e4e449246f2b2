"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM), on the model's own weights.

transformers' modeling code runs every layer through a dozen module calls (norms, projections,
rotary, the attention interface, the MLP), which at batch 1 costs more than the arithmetic of a
small model and, on a GPU, a kernel launch per projection. This pass does the same arithmetic in
one function per layer, with q/k/v in one matmul and gate/up in another (the module weights
become views into the fused tensors: no extra memory), and the engine's paged attention in
between. Every operation is the one transformers runs (same RMSNorm in float32, same rotary
tables from the model's own rotary module, same SDPA), so the logits match its forward.

Used when :func:`supports` accepts the model (plain ``nn.Linear`` projections, SiLU MLP, RMSNorm, no
sliding window); anything else runs through transformers' modules with the same paged attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from ead_llm.core.model_runner import PackedBatch

FAMILIES = ("llama", "mistral", "qwen2")


def supports(model: Any) -> bool:
    """Whether ``model`` has exactly the Llama-family structure this pass implements."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES or getattr(config, "hidden_act", None) != "silu":
        return False
    if getattr(config, "pretraining_tp", 1) != 1:
        return False
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return False
    for layer in getattr(inner, "layers", []):
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(linear) is not nn.Linear or linear.weight.dtype.is_floating_point is False for linear in linears):
            return False
    return True


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, back to the input's dtype, then the weight. (In float32
    torch's fused kernel gives the same bits in one call.)"""
    if hidden.dtype == weight.dtype == torch.float32:
        return F.rms_norm(hidden, weight.shape, weight, eps)
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps)).to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(D // 2, -1) * signed_sin(sin)`` bit
    for bit (``-(a * b) == (-a) * b`` in floating point), in two operations instead of five."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (``sin_signed``: :func:`signed_sin` of ``sin``)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * sin_signed)


def _fuse(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input; the modules keep views of it."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b.detach()
                if b is not None
                else torch.zeros(linear.out_features, dtype=weight.dtype, device=weight.device)
                for b, linear in zip(biases, linears, strict=True)
            ]
        )
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if linear.bias is not None and bias is not None:
            linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


class FusedLayer:
    """One decoder layer's weights, fused."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attention = attn
        self.index = int(attn.layer_idx)
        self.head_dim = int(attn.head_dim)
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = float(attn.scaling)
        self.qkv, self.qkv_bias = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        self.gate_up, self.gate_up_bias = _fuse(mlp.gate_proj, mlp.up_proj)
        self.down, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias
        self.input_norm = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.post_norm = (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon))
        self.qk_width = (self.heads + self.kv_heads) * self.head_dim  # q and k lie side by side in qkv's output

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """``hidden``: [1, T, hidden]; ``cos``/``sin``: [1, 1, T, D] (``sin`` as :func:`signed_sin` gives it)."""
        tokens = hidden.shape[1]
        x = rms_norm(hidden, *self.input_norm)
        qkv = F.linear(x, self.qkv, self.qkv_bias)
        # rotary on q and k together: each head's positions are rotated alike
        qk = qkv[..., : self.qk_width].view(1, tokens, self.heads + self.kv_heads, self.head_dim).transpose(1, 2)
        qk = rotary(qk, cos, sin)  # [1, H + Hkv, T, D]
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = qkv[..., self.qk_width :].view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)  # [1, Hkv, T, D]
        batch.write(self.index, k, v)
        attended = batch.attend(self.attention, q, self.scaling)  # [1, T, H, D]
        hidden = hidden + F.linear(attended.reshape(1, tokens, -1).contiguous(), self.o, self.o_bias)
        x = rms_norm(hidden, *self.post_norm)
        gate, up = F.linear(x, self.gate_up, self.gate_up_bias).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, self.down, self.down_bias)


class FusedLlama:
    """The whole model's forward on a packed batch: logits at the positions read only."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        self.embedding = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        self.head = model.lm_head.weight
        self.head_bias = model.lm_head.bias
        self.layers = [FusedLayer(layer) for layer in inner.layers]
        self.keep_features = False
        """Store every position's final hidden state (after the last norm) in the cache, for a draft that reads
        them (:mod:`ead_llm.core.fused_draft`)."""

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: PackedBatch
    ) -> torch.Tensor:
        """``ids``, ``positions``: [T]; ``keep``: [N] packed indices read -> logits [N, V] (model dtype)."""
        hidden = F.embedding(ids, self.embedding)[None]  # [1, T, hidden]
        cos, sin = self.rotary(hidden, positions[None])  # [1, T, D]
        cos, sin = cos.unsqueeze(1), signed_sin(sin.unsqueeze(1))
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, batch)
        if self.keep_features:
            hidden = rms_norm(hidden, *self.norm)
            batch.cache.write_features(batch.write_slots, hidden[0])
            hidden = hidden[:, keep]
        else:
            hidden = rms_norm(hidden[:, keep], *self.norm)
        return F.linear(hidden, self.head, self.head_bias)[0]
