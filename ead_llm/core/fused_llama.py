"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM), on the model's own weights.

transformers' modeling code runs every layer through a dozen module calls (norms, projections,
rotary, the attention interface, the MLP), which at batch 1 costs more than the arithmetic of a
small model and, on a GPU, a kernel launch per projection. This pass does the same arithmetic in
one function per layer, with q/k/v in one matmul and gate/up in another (the module weights
become views into the fused tensors: no extra memory), and the engine's paged attention in
between. Every other operation is the one transformers runs (same RMSNorm in float32, same rotary
tables from the model's own rotary module, same SDPA); the projections run through oneDNN with packed weights
on CPU in float32 (:class:`Projection`: 1.9-4x torch's default BLAS here), so the logits match its forward to
float32 rounding.

Used when :func:`supports` accepts the model (plain ``nn.Linear`` projections, SiLU MLP, RMSNorm, no
sliding window); anything else runs through transformers' modules with the same paged attention.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from ead_llm.core.model_runner import PackedBatch

FAMILIES = ("llama", "mistral", "qwen2")


def _onednn_ops() -> tuple[Any, Any] | None:
    """oneDNN's linear and its weight packing (the ops torch's CPU compiler emits when it freezes weights), or None
    where this torch build lacks them."""
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        return torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._reorder_linear_weight.default
    except (AttributeError, RuntimeError):
        return None


ONEDNN = _onednn_ops()
PACK_ROWS = 4
"""The row count oneDNN packs a weight's blocks for. Measured on SmolLM2's weights (one thread,
``benchmarks/linear_kernels.py``): packed for 1 row, 2 to 64 rows cost 1.7-2x one row; packed for 2 to 16, alike
(2 to 5 rows 1.0-1.4x one row); at least 1.9x faster than torch's default CPU BLAS from 1 to 256 rows."""


PACK_MIN_BYTES = 4 * 2**20
"""Models smaller than this run unpacked: a packed call has a fixed cost (about 12 us against 3 us for ``F.linear``,
one thread) that a tiny model's products do not repay. Measured through the runner (one thread, a decode pass at
100 positions): the embedded small model (0.2 MB) 0.22-0.24 ms unpacked against 0.53-0.69 packed; the embedded
large one (14 MB) packed 1.16-1.86 ms at 1 token (1.55-1.76 unpacked) and 1.26-1.40 at 2 (1.66-1.98)."""


def worth_packing(model: Any) -> bool:
    """Whether :class:`Projection` should pack ``model``'s weights: float32 on CPU with oneDNN, at least
    :data:`PACK_MIN_BYTES` of them, and a second copy fits in half the memory available now (a model near the
    machine's size runs unpacked)."""
    weights = list(model.parameters())
    if ONEDNN is None or not weights or any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        return False
    size = sum(w.numel() * w.element_size() for w in weights)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: pack only what is small
        available = 4 * 2**30
    return size >= PACK_MIN_BYTES and 2 * size <= available


class Projection:
    """``F.linear`` with one weight (and bias), for inference. On CPU in float32, where torch has oneDNN, the weight
    is packed once into oneDNN's blocked layout (a second copy of it: the model's own stays for its modules) and
    every call reads it there: each row's result is then the same whatever rows share the call, and differs from
    ``F.linear``'s by rounding only (tested). The packed copy is taken once: weights changed in place later are
    not seen (build the engine after changing them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, pack: bool) -> None:
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        self.pad_single = False
        """Whether one row is sent as two: oneDNN runs a single row of a wide input (1,536 inputs and more on
        this machine's CPU) through another kernel, whose last bits differ from the same row's among others."""
        self.widths: tuple[int, ...] = ()
        """``widths[r]``: how many rows a call of ``r`` rows is sent as (copies of its last row fill the rest;
        :func:`tune_widths` sets it where more rows run faster); calls of more rows go as they are."""
        if pack and ONEDNN is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.packed = ONEDNN[1](weight.detach(), PACK_ROWS)
            self.pad_single = not self._single_rows_agree()

    def _single_rows_agree(self) -> bool:
        """Whether rows called alone get the bits they get among others (which kernel oneDNN picks for one row
        depends on the shape and the CPU, so it is asked, not assumed: a different kernel sums in another order
        and differs on random rows)."""
        probe = torch.randn(4, self.weight.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            together = self._packed(probe)
            return all(torch.equal(self._packed(probe[i : i + 1]), together[i : i + 1]) for i in range(len(probe)))

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        assert ONEDNN is not None
        return ONEDNN[0](x, self.packed, self.bias, "none", [], "")

    def width(self, rows: int) -> int:
        """The rows a packed call of ``rows`` rows runs as: never one alone where one row takes another kernel."""
        wide = self.widths[rows] if rows < len(self.widths) else rows
        return 2 if wide == 1 and self.pad_single else wide

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.float32 and not torch.is_grad_enabled():
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            wide = self.width(rows)
            if wide == rows:
                return self._packed(x)
            flat = x.reshape(rows, -1)
            out = self._packed(torch.cat((flat, flat[-1:].expand(wide - rows, -1))))
            return out[:rows].view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, self.weight, self.bias)


TUNED_ROWS = 8
""":func:`tune_widths` times calls of 1 to this many rows."""
TUNE_MARGIN = 0.85
"""A call is sent as more rows only when those run in at most this share of its own time (noise does not move it)."""
TUNE_SAMPLE_S = 0.005
"""Each timed sample of :func:`tune_widths` repeats a pass's products until it takes at least about this long."""


def choose_widths(seconds: dict[int, float], margin: float = TUNE_MARGIN) -> tuple[int, ...]:
    """``widths[r]`` for ``r`` in ``0..max(seconds)``: the row count at least ``r`` whose calls took least time
    (``seconds[n]``: a pass's products at ``n`` rows), when it beats ``r``'s own by ``margin``; else ``r``."""
    top = max(seconds)
    widths = [0]
    for rows in range(1, top + 1):
        best = min(range(rows, top + 1), key=lambda n: (seconds[n], n))
        widths.append(best if seconds[best] <= margin * seconds[rows] else rows)
    return tuple(widths)


def tune_widths(projections: list[Projection], repeats: int = 3) -> tuple[int, ...]:
    """Time a model's packed projections (one pass's products) at 1 to :data:`TUNED_ROWS` rows, interleaved, and give
    each the widths :func:`choose_widths` takes from the fastest samples. On this machine's CPU a memory-bound model
    (SmolLM2: 540 MB of weights) ran its products at 1 and 2 rows in 39.9 and 47.5 ms, at 4 in 32.6: oneDNN streams
    packed weights faster with more rows. Which width a call runs as changes its time only, never its rows' bits (every
    width from two rows on gives a row the same bits, and one row runs alone only where it matches them). Timed once
    per process for a set of shapes and thread count."""
    packed = [p for p in projections if p.packed is not None]
    if not packed:
        return ()
    key = (torch.get_num_threads(), repeats, tuple((tuple(p.weight.shape), p.pad_single) for p in packed))
    widths = _TUNED.get(key)
    if widths is None:
        widths = _TUNED[key] = _time_widths(packed, repeats)
    for p in packed:
        p.widths = widths
    return widths


_TUNED: dict[tuple[Any, ...], tuple[int, ...]] = {}
"""Widths already timed in this process, by thread count and the projections' shapes: a second engine on the same
model (or another model of the same shapes) takes them instead of timing again."""


def _time_widths(packed: list[Projection], repeats: int) -> tuple[int, ...]:
    """:func:`tune_widths`'s timing: the widths for ``packed`` projections."""
    # each call as it runs untuned (one row as two where it must be); the caller's random state is left alone
    gen = torch.Generator().manual_seed(0)
    inputs = {
        n: [torch.randn(2 if n == 1 and p.pad_single else n, p.weight.shape[1], generator=gen) for p in packed]
        for n in range(1, TUNED_ROWS + 1)
    }
    samples: dict[int, list[float]] = {n: [] for n in inputs}

    def products(xs: list[torch.Tensor], times: int) -> float:
        start = time.perf_counter()
        for _ in range(times):
            for p, x in zip(packed, xs, strict=True):
                p._packed(x)
        return time.perf_counter() - start

    with torch.inference_mode():
        products(inputs[2], 1)  # untimed: oneDNN makes its kernels on first use
        # a small model's pass takes well under a millisecond: each sample runs enough passes to outlast the noise
        times = max(1, min(100, math.ceil(TUNE_SAMPLE_S / max(products(inputs[1], 1), 1e-6))))
        for _ in range(repeats):
            for n, xs in inputs.items():
                samples[n].append(products(xs, times))
    # the fastest sample of each: a busy machine only ever adds time, and a small model's widths must not follow it
    return choose_widths({n: min(times) for n, times in samples.items()})


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

    def __init__(self, layer: Any, *, pack: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attention = attn
        self.index = int(attn.layer_idx)
        self.head_dim = int(attn.head_dim)
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = float(attn.scaling)
        self.qkv = Projection(*_fuse(attn.q_proj, attn.k_proj, attn.v_proj), pack=pack)
        self.o = Projection(attn.o_proj.weight, attn.o_proj.bias, pack=pack)
        self.gate_up = Projection(*_fuse(mlp.gate_proj, mlp.up_proj), pack=pack)
        self.down = Projection(mlp.down_proj.weight, mlp.down_proj.bias, pack=pack)
        self.input_norm = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.post_norm = (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon))
        self.qk_width = (self.heads + self.kv_heads) * self.head_dim  # q and k lie side by side in qkv's output
        self.projections = [self.qkv, self.o, self.gate_up, self.down]

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """``hidden``: [1, T, hidden]; ``cos``/``sin``: [1, 1, T, D] (``sin`` as :func:`signed_sin` gives it)."""
        tokens = hidden.shape[1]
        x = rms_norm(hidden, *self.input_norm)
        qkv = self.qkv(x)
        # rotary on q and k together: each head's positions are rotated alike
        qk = qkv[..., : self.qk_width].view(1, tokens, self.heads + self.kv_heads, self.head_dim).transpose(1, 2)
        qk = rotary(qk, cos, sin)  # [1, H + Hkv, T, D]
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = qkv[..., self.qk_width :].view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)  # [1, Hkv, T, D]
        batch.write(self.index, k, v)
        attended = batch.attend(self.attention, q, self.scaling)  # [1, T, H, D]
        hidden = hidden + self.o(attended.reshape(1, tokens, -1).contiguous())
        x = rms_norm(hidden, *self.post_norm)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return hidden + self.down(F.silu(gate) * up)


class FusedLlama:
    """The whole model's forward on a packed batch: logits at the positions read only."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        pack = worth_packing(model)
        self.embedding = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        self.head = Projection(model.lm_head.weight, model.lm_head.bias, pack=pack)
        self.layers = [FusedLayer(layer, pack=pack) for layer in inner.layers]
        self.projections = [self.head, *(p for layer in self.layers for p in layer.projections)]
        tune_widths(self.projections)
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
        return self.head(hidden)[0]
