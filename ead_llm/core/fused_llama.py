"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM), on the model's own weights.

transformers' modeling code runs every layer through a dozen module calls (norms, projections,
rotary, the attention interface, the MLP), which at batch 1 costs more than the arithmetic of a
small model and, on a GPU, a kernel launch per projection. This pass does the same arithmetic in
one function per layer, with q/k/v in one matmul and gate/up in another (the module weights
become views into the fused tensors: no extra memory), and the engine's paged attention in
between. Every other operation is the one transformers runs (same RMSNorm in float32, same rotary
tables from the model's own rotary module, same SDPA); on CPU in float32 the projections run on weights prepared for
the faster of two kernels on this machine (:class:`Projection`: oneDNN's packed layout, or BLAS on the weight
transposed), each giving a row the same bits whatever rows share its call, so the logits match its forward to
float32 rounding.

Used when :func:`supports` accepts the model (plain ``nn.Linear`` projections, SiLU MLP, RMSNorm, no
sliding window); anything else runs through transformers' modules with the same paged attention.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import operator
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ead_llm.core import kernels
from ead_llm.core.sources import cache_dir, cache_lock

if TYPE_CHECKING:
    from ead_llm.core.model_runner import PackedBatch

log = logging.getLogger(__name__)

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

KERNELS = ("onednn", "blas", "native")
"""How a float32 CPU projection runs: ``onednn``, oneDNN's linear on the weight packed into its blocked layout;
``blas``, torch's BLAS (``mm``/``addmm``) on the weight stored transposed, ``[in, out]`` and contiguous; ``native``,
ead-llm's own AVX2 kernel (:mod:`ead_llm.core.kernels`) on the weight in its panels, where it builds. Each gives a
row the same bits whatever rows share its call (oneDNN and ours by construction; BLAS where :meth:`Projection.use`
finds it so on this machine; all three are probed), so a prompt's text does not depend on its place in a batch.
Which is faster depends on the machine and the model: on an AMD EPYC (Zen 4) oneDNN's packed products ran 1.9-4x
torch's default CPU BLAS; on an Intel Xeon with AVX-512 the embedded large model's decode forward took 1.80 ms with
oneDNN and 1.46 ms with BLAS (a packed call costs about 20 us there before any arithmetic), while SmolLM2 still ran
faster packed; on an AMD Zen 3 ours ran SmolLM2's products 1.3x oneDNN at one row and 1.5x at four.
:func:`choose_kernel` times them per model and records the choice for the machine."""

BFLOAT16 = "onednn-bf16"
"""A projection kernel that changes a model's arithmetic, for drafts only
(:class:`ead_llm.core.fused_draft.FusedDraft`): oneDNN's linear on the weight packed in bfloat16, the rows cast to
bfloat16 and the result back to float32. A draft's products are memory-bound at a few rows, and half the bytes cost
about half the time (the shipped SmolLM2 draft's products at one row with the caches cold, as after the target's
pass: 1.5 against 2.9 ms on an Intel Xeon with AMX). Never chosen by timing as :data:`KERNELS` are:
:meth:`Projection.use` takes it where a row's bits are the same in every call of 1 to :data:`BF16_ROWS` rows."""
NATIVE_BF16 = "native-bf16"
"""The draft's bfloat16 products on a CPU without bfloat16 arithmetic: ead-llm's own kernel on the weight rounded to
bfloat16 and widened back in registers, the rows and the sums in float32 (:mod:`ead_llm.core.kernels`). Half the
bytes of a memory-bound product on any AVX2 CPU; a row's bits the same in any call by construction. Drafts only, as
:data:`BFLOAT16`."""


OURS = ("native", NATIVE_BF16)
"""The kernels that are ead-llm's own (:mod:`ead_llm.core.kernels`): they run where it builds."""


def runs_here(kernel: str) -> bool:
    """Whether ``kernel`` can run on this machine: oneDNN's where torch has it, ours where it builds, BLAS anywhere."""
    if kernel in ("onednn", BFLOAT16):
        return ONEDNN is not None
    return kernels.available() if kernel in OURS else True


def draft_bfloat16_kernels() -> tuple[str, ...]:
    """The kernels a draft's bfloat16 products may run on here, the preferred first: :data:`BFLOAT16` where the CPU
    has bfloat16 arithmetic, then :data:`NATIVE_BF16` where ead-llm's own kernel builds. A draft takes the first on
    which every projection's rows get the same bits in any call (on an AMD Zen 4, oneDNN's bfloat16 product gave a
    few rows of 64 other bits alone than among others, so the draft runs on ours there)."""
    preferred = (BFLOAT16,) if bfloat16_native() else ()
    return (*preferred, *((NATIVE_BF16,) if kernels.available() else ()))


def draft_bfloat16_kernel() -> str | None:
    """The preferred of :func:`draft_bfloat16_kernels`, or None where there is none."""
    return next(iter(draft_bfloat16_kernels()), None)


BF16_ROWS = 64
"""A :data:`BFLOAT16` projection runs its rows in calls of at most this many: oneDNN's bfloat16 product takes
another path for larger calls (on an Intel Xeon, a row's bits among 200 rows differed from its bits among 64 for a
1,536-wide input), while 1 to 64 rows gave each row the same bits on every shape of the shipped draft."""

PACK_MIN_BYTES = 4 * 2**20
"""Models smaller than this run through BLAS without timing oneDNN: a packed call has a fixed cost (about 12 us
against 3 us for ``F.linear`` on an AMD EPYC, 20 against 8 on an Intel Xeon, one thread) that a tiny model's
products do not repay. Measured through the runner (one thread, a decode pass at 100 positions, AMD): the embedded
small model (0.2 MB) 0.22-0.24 ms unpacked against 0.53-0.69 packed."""


def first_kernel(model: Any) -> str | None:
    """The kernel ``model``'s projections start with (:data:`KERNELS`), or None for ``F.linear`` itself: float32
    on CPU only, and only where a second copy of the weights fits in half the memory available now (a model near
    the machine's size runs on its own weights). oneDNN from :data:`PACK_MIN_BYTES` of weights where torch has it,
    BLAS below (and :func:`choose_kernel` then weighs the two)."""
    weights = list(model.parameters())
    if not weights or any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        return None
    size = sum(w.numel() * w.element_size() for w in weights)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: prepare only what is small
        available = 4 * 2**30
    if 2 * size > available:
        return None
    return "onednn" if size >= PACK_MIN_BYTES and ONEDNN is not None else "blas"


PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 16, 33)
"""Row counts whose bits :meth:`Projection.use` compares with the same rows among 64."""
PAD_MAX = 4
"""The most rows a smaller call may be padded to: a kernel whose rows get the bits they get among 64 only in calls of
at least this many is still taken, its smaller calls sent as this many (copies of the last row). An AMD Zen 3's MKL
gives rows in calls of 1 to 3 other bits and agrees from 4 on; for a small model's projections a call of 4 rows
there costs 2-13 us through MKL against 22-34 us for one row through oneDNN (the embedded small model's shapes, one
thread)."""
_AGREEMENT: dict[tuple[Any, ...], int | None] = {}
"""Probes already run in this process, by kernel, shape, bias and threads: the row count from which every probed
count agrees (:meth:`Projection._agreeing_from`), None where the kernel could not pack the weight."""


def _takes(kernel: str, agreeing_from: int | None) -> bool:
    """Whether a projection may run on ``kernel`` given the row count from which its probed calls agree: at most
    :data:`PAD_MAX`, and for a draft's bfloat16 kernels one (they are not padded)."""
    if agreeing_from is None:
        return False
    return agreeing_from == 1 if kernel in (BFLOAT16, NATIVE_BF16) else agreeing_from <= PAD_MAX


class Projection:
    """``F.linear`` with one weight (and bias), for inference. On CPU in float32 the weight is prepared once for one
    of :data:`KERNELS` (a second copy of it: the model's own stays for its modules) and every call reads it there:
    each row's result is then the same whatever rows share the call, and differs from ``F.linear``'s by rounding
    only (tested). The copy is taken once: weights changed in place later are not seen (build the engine after
    changing them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, kernel: str | None) -> None:
        self.weight, self.bias = weight, bias
        self.kernel: str | None = None
        """One of :data:`KERNELS` (or :data:`BFLOAT16`, for a draft), or None: ``F.linear`` on the model's own
        weight."""
        self.packed: torch.Tensor | None = None
        """The weight as the kernel reads it (oneDNN's blocked layout, or transposed for BLAS)."""
        self.min_rows = 1
        """Calls of fewer rows are sent as this many: a kernel may run a few rows through another code path (one row:
        oneDNN for 1,536 inputs and more on an AMD EPYC, BLAS for any shape on an Intel Xeon; 1 to 3 rows: MKL on an
        AMD Zen 3), whose last bits differ from the same rows' among others."""
        self.widths: tuple[int, ...] = ()
        """``widths[r]``: how many rows a call of ``r`` rows is sent as (copies of its last row fill the rest;
        :func:`tune_widths` sets it where more rows run faster); calls of more rows go as they are."""
        if kernel is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
            # the first that gives every row the same bits in any call (its smallest calls padded): BLAS does not on
            # every CPU, and F.linear, the last resort, neither
            any(self.use(candidate) for candidate in dict.fromkeys((kernel, *KERNELS)))

    def use(self, kernel: str | None) -> bool:
        """Run on ``kernel`` from now on (None: ``F.linear``), if it gives every row the same bits whatever rows
        share its call, calls of fewer than :data:`PAD_MAX` rows aside (then padded to where they agree); False,
        changing nothing, where it does not (or oneDNN is missing)."""
        if kernel == self.kernel:
            return True
        if kernel is None:
            self.kernel, self.packed, self.min_rows = None, None, 1
            return True
        if kernel not in (*KERNELS, BFLOAT16, NATIVE_BF16):
            raise ValueError(f"kernel must be one of {(*KERNELS, BFLOAT16, NATIVE_BF16)} or None, got {kernel!r}")
        if not runs_here(kernel):
            return False
        key = (kernel, tuple(self.weight.shape), self.bias is not None, torch.get_num_threads())
        if key in _AGREEMENT and not _takes(kernel, _AGREEMENT[key]):  # refused before: nothing to pack or probe
            return False
        weight = self.weight.detach()
        was = (self.kernel, self.packed, self.min_rows)
        try:
            if kernel == "blas":
                packed = weight.t().contiguous()
            elif kernel == "onednn":
                packed = ONEDNN[1](weight, PACK_ROWS)  # type: ignore[index]
            elif kernel in OURS:
                packed = kernels.pack(weight, bfloat16=kernel == NATIVE_BF16)
            else:  # packed for one row: the layout whose bits did not change with the row count (PACK_ROWS' did)
                packed = ONEDNN[1](weight.to(torch.bfloat16), 1)  # type: ignore[index]
        except RuntimeError:  # this CPU's oneDNN has no such path (bfloat16 wants AVX-512 or AVX-NE-CONVERT)
            _AGREEMENT[key] = None
            return False
        self.kernel, self.packed = kernel, packed
        if key not in _AGREEMENT:
            counts = range(2, BF16_ROWS + 1) if kernel == BFLOAT16 else PROBE_ROWS[1:]
            _AGREEMENT[key] = self._agreeing_from(counts)
        agreement = _AGREEMENT[key]
        if not _takes(kernel, agreement):
            self.kernel, self.packed, self.min_rows = was
            return False
        assert agreement is not None
        self.min_rows = agreement
        return True

    def _agreeing_from(self, counts: Iterable[int]) -> int:
        """The row count from which rows called in groups of one and of each of ``counts`` get the bits they get
        among 64 (one past the largest count that differs; 1 when all agree). Which code path a kernel takes for a
        row count depends on the shape and the CPU, so it is asked, not assumed: another path sums in another order
        and differs on random rows, though not on every one (oneDNN's bfloat16 product for one row, on an AMD Zen 4:
        2 to 5 rows of 64), so every row is asked alone."""
        probe = torch.randn(64, self.weight.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            together = self._packed(probe)

            def agree(rows: int) -> bool:
                if rows == 1:
                    return all(torch.equal(self._packed(probe[r : r + 1]), together[r : r + 1]) for r in range(64))
                return torch.equal(self._packed(probe[:rows]), together[:rows]) and torch.equal(
                    self._packed(probe[-rows:]), together[-rows:]
                )

            return max((rows + 1 for rows in (1, *counts) if not agree(rows)), default=1)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None
        if self.kernel == "blas":
            flat = x.reshape(-1, x.shape[-1])
            out = torch.mm(flat, self.packed) if self.bias is None else torch.addmm(self.bias, flat, self.packed)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.kernel in OURS:
            return kernels.linear(x, self.packed, self.weight.shape[0], self.bias)
        assert ONEDNN is not None
        if self.kernel == BFLOAT16:
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            pieces = [ONEDNN[0](piece, self.packed, bias, "none", [], "") for piece in flat.split(BF16_ROWS)]
            out = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).float()
            return out.view(*x.shape[:-1], out.shape[-1])
        return ONEDNN[0](x, self.packed, self.bias, "none", [], "")

    @property
    def fuses(self) -> bool:
        """Whether :meth:`fused` runs here: the weight on one of ead-llm's own kernels (:data:`OURS`), inference."""
        return self.kernel in OURS and not torch.is_grad_enabled()

    def fused(
        self,
        x: torch.Tensor,
        *,
        norm: tuple[torch.Tensor, float] | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """The projection of ``x`` ``[rows, in]`` with the work around it in one call of the kernel
        (:func:`ead_llm.core.kernels.fused`); only where :attr:`fuses`."""
        assert self.packed is not None and self.kernel in OURS
        return kernels.fused(
            x, self.packed, self.weight.shape[0], self.bias, norm=norm, gated=gated, residual=residual, rotary=rotary
        )

    def width(self, rows: int) -> int:
        """The rows a call of ``rows`` rows runs as: never fewer than :attr:`min_rows`."""
        wide = self.widths[rows] if rows < len(self.widths) else rows
        return self.min_rows if 0 < wide < self.min_rows else wide

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.float32 and not torch.is_grad_enabled():
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            wide = self.width(rows)
            if wide == rows:
                return self._packed(x)
            flat = x.reshape(rows, -1)
            padded = flat.expand(wide, -1) if rows == 1 else torch.cat((flat, flat[-1:].expand(wide - rows, -1)))
            out = self._packed(padded)
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
    """Time a model's prepared projections (one pass's products) at 1 to :data:`TUNED_ROWS` rows, interleaved, and
    give each the widths :func:`choose_widths` takes from the fastest samples. On an AMD EPYC a memory-bound model
    (SmolLM2: 540 MB of weights) ran its packed products at 1 and 2 rows in 39.9 and 47.5 ms, at 4 in 32.6: oneDNN
    streams packed weights faster with more rows. Which width a call runs as changes its time only, never its rows'
    bits (every width from :attr:`Projection.min_rows` on gives a row the same bits, and no call runs as fewer).
    Timed once per process for a kernel, a set of shapes and a thread count."""
    packed = [p for p in projections if p.packed is not None]
    if not packed:
        return ()
    key = (torch.get_num_threads(), repeats, *_shapes(packed))
    widths = _TUNED.get(key)
    if widths is None:
        widths = _TUNED[key] = _time_widths(packed, repeats)
    for p in packed:
        p.widths = widths
    return widths


_TUNED: dict[tuple[Any, ...], tuple[int, ...]] = {}
"""Widths already timed in this process, by thread count and the projections' kernels and shapes: a second engine
on the same model (or another model of the same shapes) takes them instead of timing again."""


GROUP_CHOICES = (kernels.GROUP_MOST, 4)
""":func:`tune_group`'s candidates for the most rows a group of the kernel takes, the kernel's default first."""
GROUP_ROWS = (5, 6)
"""The calls :func:`tune_group` times: a verification of four or five drafts (fewer rows run as one group anyway)."""
GROUP_MARGIN = 0.95
"""Another group size is taken only when its calls run in at most this share of the default's time."""
_chosen_group: list[int] = []
"""The group size this process took (:func:`tune_group` times it once)."""


def tune_group(projections: list[Projection], repeats: int = 5) -> int:
    """Time a memory-bound model's products at :data:`GROUP_ROWS` rows with each of :data:`GROUP_CHOICES` as the
    kernel's group size (:func:`ead_llm.core.kernels.set_group`), interleaved, and keep the fastest: once per
    process, by the first model on ead-llm's float32 kernel with at least :data:`PACK_MIN_BYTES` of weights (a smaller
    one's products stay in the cache, where this does not show). On an AMD Zen 4, SmolLM2's products at 5 and 6
    rows took 26.5 and 28.0 ms as one group and 24.5 and 24.4 as two of at most 4 rows; on Intel and Zen 3 the
    default stays unless its timing says so. Changes time only, never bits. Returns the group size in force."""
    packed = [p for p in projections if p.kernel == "native" and p.packed is not None]
    size = sum(p.weight.numel() * p.weight.element_size() for p in packed)
    if _chosen_group or not packed or size < PACK_MIN_BYTES:
        return kernels.group() if packed else GROUP_CHOICES[0]
    gen = torch.Generator().manual_seed(0)
    inputs = {rows: [torch.randn(rows, p.weight.shape[1], generator=gen) for p in packed] for rows in GROUP_ROWS}

    def products(most: int) -> Callable[[], object]:
        def run() -> object:
            kernels.set_group(most)
            return [p._packed(x) for xs in inputs.values() for p, x in zip(packed, xs, strict=True)]

        return run

    try:
        seconds = _fastest_samples({most: products(most) for most in GROUP_CHOICES}, repeats)
    finally:
        kernels.set_group(GROUP_CHOICES[0])
    default = seconds[GROUP_CHOICES[0]]
    best = min(seconds, key=lambda most: (seconds[most], most != GROUP_CHOICES[0]))
    chosen = best if seconds[best] <= GROUP_MARGIN * default else GROUP_CHOICES[0]
    kernels.set_group(chosen)
    _chosen_group.append(chosen)
    log.info("kernel groups of at most %d rows (%s ms)", chosen, {m: round(t * 1e3, 2) for m, t in seconds.items()})
    return chosen


def _shapes(packed: list[Projection]) -> tuple[tuple[Any, ...], ...]:
    return tuple((p.kernel, tuple(p.weight.shape), p.bias is not None, p.min_rows) for p in packed)


def _time_widths(packed: list[Projection], repeats: int) -> tuple[int, ...]:
    """:func:`tune_widths`'s timing: the widths for ``packed`` projections."""
    return choose_widths(_time_rows(packed, repeats))


def _time_rows(packed: list[Projection], repeats: int) -> dict[int, float]:
    """Seconds of ``packed``'s products at 1 to :data:`TUNED_ROWS` rows (the fastest of ``repeats`` samples)."""
    # each call as it runs untuned (padded to its kernel's fewest rows), each distinct one timed once; the caller's
    # random state is left alone
    runs = {n: tuple(max(n, p.min_rows) for p in packed) for n in range(1, TUNED_ROWS + 1)}
    gen = torch.Generator().manual_seed(0)
    inputs = {
        rows: [torch.randn(r, p.weight.shape[1], generator=gen) for p, r in zip(packed, rows, strict=True)]
        for rows in dict.fromkeys(runs.values())
    }

    def products(xs: list[torch.Tensor]) -> Callable[[], object]:
        return lambda: [p._packed(x) for p, x in zip(packed, xs, strict=True)]

    seconds = _fastest_samples({rows: products(xs) for rows, xs in inputs.items()}, repeats)
    return {n: seconds[rows] for n, rows in runs.items()}


def _time_passes(run: Callable[[int], object], repeats: int) -> dict[int, float]:
    """Seconds of ``run(rows)`` (a model's pass of ``rows`` tokens without attention: :class:`NoAttention`) at 1 to
    :data:`TUNED_ROWS` rows (the fastest of ``repeats`` samples)."""
    return _fastest_samples({n: functools.partial(run, n) for n in range(1, TUNED_ROWS + 1)}, repeats)


def _fastest_samples(work: dict[Any, Callable[[], object]], repeats: int) -> dict[Any, float]:
    """Seconds of each of ``work``'s calls: the fastest of ``repeats`` samples, the calls interleaved."""

    def timed(call: Callable[[], object], times: int) -> float:
        start = time.perf_counter()
        for _ in range(times):
            call()
        return time.perf_counter() - start

    first = next(iter(work.values()))
    samples: dict[Any, list[float]] = {key: [] for key in work}
    with torch.inference_mode():
        timed(first, 1)  # untimed: a kernel makes its code paths on first use
        # a small model's pass takes well under a millisecond: each sample runs enough calls to outlast the noise
        times = max(1, min(100, math.ceil(TUNE_SAMPLE_S / max(timed(first, 1), 1e-6))))
        for _ in range(repeats):
            for key, call in work.items():
                samples[key].append(timed(call, times) / times)
    # the fastest sample of each: a busy machine only ever adds time, and a small model's widths must not follow it
    return {key: min(times) for key, times in samples.items()}


class NoAttention:
    """A stand-in for a pass's :class:`~ead_llm.core.model_runner.PackedBatch` when a model's pass is timed without
    its attention (:func:`choose_kernel`): nothing is stored, and each query's "attention" is its own vector."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.cache = self
        self.write_slots = None

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores nothing."""

    def write_features(self, slots: object, features: torch.Tensor) -> None:
        """Stores nothing."""

    def attend(self, attention: object, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """``q`` ``[1, H, T, D]`` as ``[1, T, H, D]``."""
        return q.transpose(1, 2)


def kernel_cost(seconds: dict[int, float]) -> float:
    """One figure for a kernel's times per row count: calls of 1 to :data:`TUNED_ROWS` rows, each at its best width,
    added up (decode at one row and verification or a few callers at a few rows weigh alike)."""
    widths = choose_widths(seconds)
    return sum(seconds[widths[rows]] for rows in range(1, len(widths)))


def choose_kernel(
    projections: list[Projection], repeats: int = 3, passes: Callable[[int], object] | None = None
) -> str | None:
    """Put a model's prepared projections on the fastest of its :func:`candidates` and return it. With ``passes`` (a
    model's pass of a given number of tokens, without its attention) each candidate is timed on what it runs: the
    whole pass, on ours with the norms, rotary turn, residual adds and gating inside its calls, on the others as torch
    operations; without, on the projections' products alone (as :func:`tune_widths` times widths). Only kernels that
    keep every row's bits whatever rows share a call are timed. The choice changes the last bits of the logits, so it
    is taken once per machine and kept in :func:`kernel_record` (keyed by the CPU, torch's version, the thread count,
    the candidates, what was timed and the shapes): every later process on the machine runs the same kernel, and the
    same seed gives the same text. Projections left on ``F.linear`` (no kernel gives their rows the same bits) are not
    timed; a model whose prepared projections start on different kernels stays as it is."""
    prepared = [p for p in projections if p.packed is not None]
    start = prepared[0].kernel if prepared else None
    if start is None or start not in KERNELS or any(p.kernel != start for p in prepared):
        return projections[0].kernel if projections else None
    if candidates(prepared) == (start,):  # nothing to weigh it against
        return start
    key = kernel_key(prepared, whole=passes is not None)
    chosen = _recorded_kernel(key)
    timed: dict[str, dict[int, float]] = {}
    if chosen is None:
        # one process times at a time: one that waited takes the record the first wrote, and timings of two
        # processes do not share the CPU
        with _RECORD_LOCK, cache_lock(KERNEL_LOCK):
            chosen = _recorded_kernel(key)
            if chosen is None:
                for kernel in candidates(prepared):
                    if all(p.use(kernel) for p in prepared):
                        timed[kernel] = (
                            _time_rows(prepared, repeats) if passes is None else _time_passes(passes, repeats)
                        )
                costs = {k: kernel_cost(seconds) for k, seconds in timed.items()}
                chosen = fastest(costs, start)
                _record_kernel(key, chosen, {k: round(v * 1e3, 4) for k, v in costs.items()})
    if not all(p.use(chosen) for p in prepared):  # a record from another build whose BLAS now differs per row
        for p in prepared:
            p.use(start)
        return start
    if chosen in timed and passes is None:  # its products' widths are timed already: tune_widths takes them
        _TUNED[(torch.get_num_threads(), repeats, *_shapes(prepared))] = choose_widths(timed[chosen])
    return chosen


OWN_MARGIN = 0.85
"""Another kernel is chosen over ours only when it costs at most this share of ours. Timed on products alone, ours
also runs a layer's norms, rotary turn, residual adds and gating inside its calls, which the timing does not count
(the embedded large model's decode forward: 1.03 ms on ours, 1.71 with those as torch operations, whose products cost
0.47 of it); timed on whole passes, it keeps a noisy timing from trading ours for a kernel no faster."""


def fastest(costs: dict[str, float], start: str) -> str:
    """The kernel :func:`choose_kernel` takes from the timed ``costs``: the cheapest, ours unless another beats it by
    :data:`OWN_MARGIN` (``start`` when nothing was timed)."""
    if not costs:
        return start
    best = min(costs, key=lambda k: costs[k])
    if "native" in costs and costs[best] > OWN_MARGIN * costs["native"]:
        return "native"
    return best


def candidates(prepared: list[Projection]) -> tuple[str, ...]:
    """The kernels :func:`choose_kernel` times for a model's projections: those of :data:`KERNELS` that run here,
    oneDNN only for projections that started on it (a model under :data:`PACK_MIN_BYTES` does not repay its fixed
    cost a call)."""
    start = prepared[0].kernel if prepared else None
    return tuple(k for k in KERNELS if runs_here(k) and (k != "onednn" or start == "onednn"))


def kernel_key(prepared: list[Projection], *, whole: bool = False) -> str:
    """The record's key for a model's projections on this machine (``whole``: timed on whole passes)."""
    shapes = sorted({(tuple(p.weight.shape), p.bias is not None) for p in prepared})
    timed = ",".join(k if k != "native" else f"native {kernels.VERSION}" for k in candidates(prepared))
    what = "|passes" if whole else ""
    return f"{cpu_name()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{timed}{what}|{shapes}"


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU as a kernel choice must tell it apart: its model name, family, model and stepping and a digest of
    its feature flags (``/proc/cpuinfo``, or ``cpuinfo``'s text), else what ``platform`` says. The name alone is not
    enough: a virtual machine may report a Zen 3 and a Zen 4 both as "AMD EPYC", whose kernels differ in speed and in
    which give a row the same bits in any call (a choice timed on one would be taken on the other)."""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():  # the first processor's block
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    if "model name" not in fields:
        return f"{platform.machine()} {platform.processor()}".strip()
    flags = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()[:12]
    detail = " ".join(f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping") if key in fields)
    return f"{fields['model name']} ({detail}, flags {flags})"


def kernel_record() -> Path:
    """Where the kernels chosen on this machine are kept: ``linear_kernels.json`` in ``$EAD_LLM_CACHE`` or
    ``~/.cache/ead-llm``."""
    return cache_dir() / "linear_kernels.json"


_RECORD_LOCK = threading.Lock()
KERNEL_LOCK = ".linear_kernels.lock"
"""The file in :func:`ead_llm.core.sources.cache_dir` that one process at a time holds to choose and record."""


def _read_record() -> dict[str, Any]:
    try:
        record = json.loads(kernel_record().read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _recorded_kernel(key: str) -> str | None:
    entry = _read_record().get(key)
    kernel = entry.get("kernel") if isinstance(entry, dict) else None
    return kernel if kernel in KERNELS else None


def _record_kernel(key: str, kernel: str, costs: dict[str, float]) -> None:
    """Add ``kernel`` for ``key`` to the record (the caller holds :data:`KERNEL_LOCK`, so no other process writes
    between this read and write); the file is replaced whole, never seen half written. A machine where it cannot be
    written keeps the choice for this process."""
    record = _read_record()
    record[key] = {"kernel": kernel, "ms_per_pass": costs}
    path = kernel_record()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
        scratch.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(scratch, path)
    except OSError:
        pass


def bfloat16_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware for oneDNN (AVX-512 BF16 or AMX; elsewhere oneDNN converts,
    and :data:`BFLOAT16` would not pay)."""
    try:
        return ONEDNN is not None and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


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


STATIC_ROPE = ("default", "linear", "llama3")
"""Rope types whose frequencies do not depend on the sequence's length (``dynamic`` and ``longrope`` rescale them as a
sequence grows: those call the module every pass)."""
ROTARY_MIN_LENGTH = 512
"""Positions a rotary table holds at first (it doubles as sequences grow)."""


class RotaryTable:
    """The model's rotary module's cos and :func:`signed_sin` for positions ``0..n-1``, computed by the module itself
    once per doubling of ``n`` and indexed per pass, instead of calling the module (its decorator, a product, a
    concatenation and two transcendentals) at every pass of every model. Each angle is one product of a position and
    a frequency and the rest is elementwise, so the table holds the bits a call gives; that is checked once on a few
    positions, and a module whose rows disagree (or whose rope type rescales with the length) is called every pass."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.static = getattr(module, "rope_type", "default") in STATIC_ROPE
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def __call__(self, like: torch.Tensor, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[1, 1, T, D]`` of ``positions`` ``[T]`` (all below ``length``), in ``like``'s dtype."""
        if self.static and (
            self.cos is None
            or self.cos.shape[0] < length
            or self.cos.dtype != like.dtype
            or self.cos.device != like.device
        ):
            self._build(like, max(length, ROTARY_MIN_LENGTH, 2 * (0 if self.cos is None else self.cos.shape[0])))
        if not self.static or self.cos is None or self.sin is None:
            cos, sin = self.module(like, positions[None])
            return cos.unsqueeze(1), signed_sin(sin.unsqueeze(1))
        return self.cos[positions][None, None], self.sin[positions][None, None]

    def _build(self, like: torch.Tensor, length: int) -> None:
        everywhere = torch.arange(length, device=like.device)
        cos, sin = self.module(like, everywhere[None])
        self.cos, self.sin = cos[0], signed_sin(sin[0])
        probe = torch.tensor([0, 1, 7, length // 2, length - 1], device=like.device)
        alone = [self.module(like, probe[i : i + 1][None]) for i in range(len(probe))]
        if not all(
            torch.equal(c[0, 0], self.cos[p]) and torch.equal(signed_sin(s[0, 0]), self.sin[p])
            for (c, s), p in zip(alone, probe.tolist(), strict=True)
        ):
            self.static, self.cos, self.sin = False, None, None


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

    def __init__(self, layer: Any, *, kernel: str | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attention = attn
        self.index = int(attn.layer_idx)
        self.head_dim = int(attn.head_dim)
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = float(attn.scaling)
        self.qkv = Projection(*_fuse(attn.q_proj, attn.k_proj, attn.v_proj), kernel=kernel)
        self.o = Projection(attn.o_proj.weight, attn.o_proj.bias, kernel=kernel)
        self.gate_up = Projection(*_fuse(mlp.gate_proj, mlp.up_proj), kernel=kernel)
        self.down = Projection(mlp.down_proj.weight, mlp.down_proj.bias, kernel=kernel)
        self.input_norm = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.post_norm = (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon))
        self.qk_width = (self.heads + self.kv_heads) * self.head_dim  # q and k lie side by side in qkv's output
        self.projections = [self.qkv, self.o, self.gate_up, self.down]

    @property
    def fuses(self) -> bool:
        """Whether the layer runs as four calls of ead-llm's own kernel around its attention (:meth:`_fused`)."""
        return (
            all(projection.fuses for projection in self.projections)
            and self.head_dim <= kernels.ROTARY_MAX_DIM
            and self.input_norm[0].dtype == self.post_norm[0].dtype == torch.float32
        )

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """``hidden``: [1, T, hidden]; ``cos``/``sin``: [1, 1, T, D] (``sin`` as :func:`signed_sin` gives it)."""
        if hidden.dtype == torch.float32 and self.fuses:
            return self._fused(hidden, cos, sin, batch)
        tokens = hidden.shape[1]
        x = rms_norm(hidden, *self.input_norm)
        qk, v = self._heads(self.qkv(x))
        qk = rotary(qk, cos, sin)  # on q and k together: each head's positions are rotated alike
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        batch.write(self.index, k, v)
        attended = batch.attend(self.attention, q, self.scaling)  # [1, T, H, D]
        hidden = hidden + self.o(attended.reshape(1, tokens, -1).contiguous())
        x = rms_norm(hidden, *self.post_norm)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return hidden + self.down(F.silu(gate) * up)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k ``[1, H + Hkv, T, D]`` and v ``[1, Hkv, T, D]``: views of the qkv projection's ``[1, T, qkv]``."""
        tokens = qkv.shape[1]
        qk = qkv[..., : self.qk_width].view(1, tokens, self.heads + self.kv_heads, self.head_dim).transpose(1, 2)
        return qk, qkv[..., self.qk_width :].view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)

    def _fused(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """:meth:`__call__` with everything but the attention in the kernel: the norm, the rotary turn and the
        residual adds inside the projections' calls, and ``silu(gate) * up`` inside the down projection's. A small
        model's layer otherwise spends most of its time dispatching two dozen small operations (the embedded large
        model's decode forward: 1.7 ms, of which its products 0.47)."""
        tokens = hidden.shape[1]
        flat = hidden[0]
        turn = (cos[0, 0].contiguous(), sin[0, 0].contiguous(), self.heads + self.kv_heads)
        qk, v = self._heads(self.qkv.fused(flat, norm=self.input_norm, rotary=turn)[None])  # q and k turned
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        batch.write(self.index, k, v)
        attended = batch.attend(self.attention, q, self.scaling).reshape(tokens, -1).contiguous()  # [T, H * D]
        flat = self.o.fused(attended, residual=flat)
        gate_up = self.gate_up.fused(flat, norm=self.post_norm)
        return self.down.fused(gate_up, gated=True, residual=flat)[None]


_PACKED = operator.attrgetter("packed")


class FusedLlama:
    """The whole model's forward on a packed batch: logits at the positions read only."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        kernel = first_kernel(model)
        self.embedding = inner.embed_tokens.weight
        self.rotary = RotaryTable(inner.rotary_emb)
        self.norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        self.head = Projection(model.lm_head.weight, model.lm_head.bias, kernel=kernel)
        self.layers = [FusedLayer(layer, kernel=kernel) for layer in inner.layers]
        self.layer_projections = [p for layer in self.layers for p in layer.projections]
        self.projections = [self.head, *self.layer_projections]
        self.keep_features = False
        """Store every position's final hidden state (after the last norm) in the cache, for a draft that reads
        them (:mod:`ead_llm.core.fused_draft`)."""
        self.one_call = True
        """Run a pass whose every query lies past its row's prompt as one kernel call over all the layers
        (:meth:`_native_table`); False: one call per operation (the same bits, slower)."""
        self._table: tuple[Any, tuple[torch.Tensor | None, ...]] | None = None
        """The layers as :func:`ead_llm.core.kernels.layers` reads them, and the packed weights it was built from
        (:meth:`_native_table`)."""
        choose_kernel(self.projections, passes=self.timed_pass)
        tune_group(self.projections)
        tune_widths(self.projections)

    def timed_pass(self, tokens: int) -> torch.Tensor:
        """A pass of ``tokens`` new tokens without attention (:class:`NoAttention`), as :func:`choose_kernel` times
        it."""
        positions = torch.arange(tokens)
        return self(torch.zeros(tokens, dtype=torch.long), positions, positions, NoAttention(tokens))  # type: ignore[arg-type]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: PackedBatch
    ) -> torch.Tensor:
        """``ids``, ``positions``: [T]; ``keep``: [N] packed indices read -> logits [N, V] (model dtype)."""
        hidden = F.embedding(ids, self.embedding)[None]  # [1, T, hidden]
        cos, sin = self.rotary(hidden, positions, batch.length)
        table = self._native_table(hidden, batch)
        if table is not None:
            self._native_layers(table, hidden[0], cos[0, 0].contiguous(), sin[0, 0].contiguous(), batch)
        else:
            for layer in self.layers:
                hidden = layer(hidden, cos, sin, batch)
        if self.keep_features:
            hidden = rms_norm(hidden, *self.norm)
            batch.cache.write_features(batch.write_slots, hidden[0])
            hidden = hidden[:, keep]
        elif self.head.fuses and hidden.dtype == self.norm[0].dtype == torch.float32:
            return self.head.fused(hidden[0, keep], norm=self.norm)
        else:
            hidden = rms_norm(hidden[:, keep], *self.norm)
        return self.head(hidden)[0]

    def _native_table(self, hidden: torch.Tensor, batch: PackedBatch) -> Any:
        """The layers' table for one call of :func:`ead_llm.core.kernels.layers`, where the pass can run so: every
        query a decode step over the cache (:class:`~ead_llm.core.model_runner.NativeQueries` for all of them),
        every layer fused on ead-llm's float32 kernel, one shape of heads and one scale. Built once, again after a
        projection's kernel changed; None otherwise (the layers run one call at a time)."""
        native = getattr(batch, "native", None)
        if not self.one_call or native is None or native.index is not None or hidden.dtype != torch.float32:
            return None
        if torch.is_grad_enabled():
            return None
        packed = tuple(map(_PACKED, self.layer_projections))
        if self._table is None or any(map(operator.is_not, self._table[1], packed)):
            self._table = (self._build_table(), packed)
        return self._table[0]

    def _build_table(self) -> Any:
        first = self.layers[0]
        shape = (first.heads, first.kv_heads, first.head_dim, first.scaling)
        if not all(
            layer.fuses
            and (layer.heads, layer.kv_heads, layer.head_dim, layer.scaling) == shape
            and all(p.kernel == "native" and p.packed is not None for p in layer.projections)
            and all(t.is_contiguous() for t in (layer.input_norm[0], layer.post_norm[0]))
            and all(p.bias is None or p.bias.is_contiguous() for p in layer.projections)
            for layer in self.layers
        ):
            return None

        def at(tensor: torch.Tensor | None) -> int | None:
            return None if tensor is None else tensor.data_ptr()

        return (kernels.Layer * len(self.layers))(
            *(
                kernels.Layer(
                    at(layer.input_norm[0]),
                    at(layer.post_norm[0]),
                    layer.input_norm[1],
                    layer.post_norm[1],
                    *(at(t) for p in layer.projections for t in (p.packed, p.bias)),
                    layer.down.weight.shape[1],
                )
                for layer in self.layers
            )
        )

    def _native_layers(
        self, table: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch
    ) -> None:
        """Every layer over ``hidden`` ``[T, hidden]`` (in place) in one kernel call; see :meth:`_native_table`."""
        first = self.layers[0]
        native = batch.native
        assert native is not None
        like = hidden.new_empty((0, first.kv_heads, first.head_dim))
        storage = [batch.cache.storage(layer.index, like) for layer in self.layers]
        kernels.layers(
            table,
            hidden,
            (first.heads, first.kv_heads, first.head_dim),
            (cos, sin),
            storage,
            batch.write_slots,
            (native.tables, native.meta, batch.cache.block_size, first.scaling),
        )
