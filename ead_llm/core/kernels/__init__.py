"""ead-llm's own CPU projection kernel (``rows.c``): float32, AVX2 and FMA, a row's bits the same in any call.

Compiled on first use with the machine's C compiler into :func:`ead_llm.core.sources.cache_dir` (about a
second, once per machine and source) and called through ``ctypes``, which releases the interpreter lock while it
runs. Where there is no compiler, the CPU lacks AVX2 or FMA, or ``EAD_LLM_NATIVE_KERNEL=0`` is set,
:func:`available` is False and the engine keeps torch's kernels.

Why a kernel of our own: at the few rows a decode step or a verification of a few drafts sends, oneDNN and MKL
run their products through paths that neither stream the weights at the memory's speed nor give a row the same
bits in calls of 1 to 3 rows on every CPU (``ead_llm.core.fused_llama.PAD_MAX``). This one keeps up to six rows'
accumulators in registers while one pass over each weight panel serves them all, and sums every output in one
fixed order.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ead_llm.core.sources import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rows.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
"""``-ffp-contract=off``: the compiler fuses nothing the source does not (the bias is added after each chain)."""
DISABLE = "EAD_LLM_NATIVE_KERNEL"
"""Set to ``0`` to keep the engine on torch's kernels."""

VERSION = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]
"""The kernel's source digest: the compiled library's name and a record of kernel choices carry it, so a changed
kernel is built and timed anew."""

_LOCK = threading.Lock()
_LIBRARY: list[ctypes.CDLL | None] = []


def available() -> bool:
    """Whether the kernel runs here (compiled now if it was not yet)."""
    return _library() is not None


def _supported() -> bool:
    if os.environ.get(DISABLE, "1").strip() == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _library() -> ctypes.CDLL | None:
    with _LOCK:
        if not _LIBRARY:
            _LIBRARY.append(_load() if _supported() else None)
        return _LIBRARY[0]


def _load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: ead-llm's own CPU kernel is not built, torch's run")
        return None
    digest = hashlib.sha256(" ".join((VERSION, compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"rows-{digest}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        log.warning("ead-llm's own CPU kernel did not build (%s %s): torch's kernels run", error, detail[-400:])
        return None
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    library.ead_rows_pack.argtypes = [pointer, int64, int64, pointer]
    library.ead_rows_pack.restype = None
    library.ead_rows_pack16.argtypes = [pointer, int64, int64, pointer]
    library.ead_rows_pack16.restype = None
    for linear in (library.ead_rows_linear, library.ead_rows_linear_bf16):
        linear.argtypes = [pointer, int64, int64, pointer, int64, pointer, pointer, int64]
        linear.restype = None
    for fused in (library.ead_rows_fused, library.ead_rows_fused_bf16):
        fused.argtypes = [pointer, int64, int64, pointer, ctypes.c_float, int64, pointer, int64, pointer, pointer]
        fused.argtypes += [pointer, pointer, pointer, int64, int64, int64]
        fused.restype = int64
    library.ead_attend.argtypes = [pointer, int64, int64, int64, int64, int64, int64, pointer, pointer, int64, int64]
    library.ead_attend.argtypes += [pointer, int64, pointer, ctypes.c_float, pointer]
    library.ead_attend.restype = int64
    library.ead_layers.argtypes = [ctypes.POINTER(Layer), int64, pointer, pointer, pointer, *[int64] * 5, pointer]
    library.ead_layers.argtypes += [pointer, pointer, int64, int64, pointer, int64, pointer, ctypes.c_float, int64]
    library.ead_layers.restype = int64
    library.ead_row_stats.argtypes = [pointer, int64, int64, int64, pointer, pointer]
    library.ead_row_stats.restype = None
    library.ead_nucleus.argtypes = [pointer, int64, int64, int64, pointer, ctypes.c_double, pointer, pointer, pointer]
    library.ead_nucleus.restype = int64
    library.ead_rows_panel_width.restype = int64
    library.ead_rows_set_group.argtypes = [int64]
    library.ead_rows_set_group.restype = None
    library.ead_rows_group.restype = int64
    return library


def _build(compiler: str, target: Path) -> None:
    """Compile into a file beside ``target``, then rename it there: a process loading it never sees it half
    written, and a build that fails leaves nothing behind."""
    handle, name = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    scratch = Path(name)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(scratch), "-lm"], check=True, capture_output=True, timeout=120
        )
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)


def pack(weight: torch.Tensor, *, bfloat16: bool = False) -> torch.Tensor:
    """``weight`` ``[out, in]`` (float32, CPU) in the kernel's panels: a new flat tensor. ``bfloat16``: the weight
    rounded to bfloat16 (as ``weight.to(torch.bfloat16)`` rounds it) and kept so, for a draft, whose products may round:
    half the bytes to read, the arithmetic still float32 (int16 storage holding the bfloat16 bits)."""
    library = _library()
    if library is None:
        raise RuntimeError("ead-llm's own CPU kernel is not available here (see ead_llm.core.kernels.available)")
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"the kernel packs a 2-D float32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    width = int(library.ead_rows_panel_width())
    size = -(-n // width) * width * k
    if bfloat16:
        bits = weight.to(torch.bfloat16).view(torch.int16)
        packed = torch.empty(size, dtype=torch.int16)
        library.ead_rows_pack16(bits.data_ptr(), n, k, packed.data_ptr())
        return packed
    packed = torch.empty(size, dtype=torch.float32)
    library.ead_rows_pack(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[..., in]`` (float32, CPU) and ``packed`` from :func:`pack` (float32, or
    bfloat16 weights). Kept lean: a small model's pass makes a call per projection."""
    library = _LIBRARY[0] if _LIBRARY else _library()
    assert library is not None, "pack() first"
    run = library.ead_rows_linear_bf16 if packed.dtype == torch.int16 else library.ead_rows_linear
    if not x.is_contiguous():
        x = x.contiguous()
    k = x.shape[-1]
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
    rows = x.numel() // k if k else 0
    if rows:
        bias_at = None if bias is None else bias.contiguous().data_ptr()
        run(x.data_ptr(), rows, k, packed.data_ptr(), out_features, bias_at, out.data_ptr(), torch.get_num_threads())
    return out


GROUP_MOST = 6
"""The most rows one call of the kernel's micro-kernels takes (``MR`` in ``rows.c``): :func:`set_group`'s ceiling."""


def group() -> int:
    """The most rows the kernel runs as one group over a panel (a call of more rows runs as several groups of even
    size; see ``ead_rows_set_group`` in ``rows.c``)."""
    library = _library()
    return GROUP_MOST if library is None else int(library.ead_rows_group())


def set_group(most: int) -> None:
    """Run calls as groups of at most ``most`` rows (1 to :data:`GROUP_MOST`), for every caller in this process:
    their time changes, never their bits (each output is one chain over its inputs in any group)."""
    if not 1 <= most <= GROUP_MOST:
        raise ValueError(f"a group holds 1 to {GROUP_MOST} rows, got {most}")
    library = _library()
    if library is None:
        raise RuntimeError("ead-llm's own CPU kernel is not available here (see ead_llm.core.kernels.available)")
    library.ead_rows_set_group(most)


ROTARY_MAX_DIM = 512
"""The widest head :func:`fused` turns (the kernel's scratch for one head)."""


def fused(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """:func:`linear` with the work around a decoder layer's projection in the same call: ``[rows, out]`` for ``x``
    ``[rows, in]`` (contiguous float32).

    ``norm`` (weight, eps): the rows are RMS-normalised first (transformers' ``LlamaRMSNorm``). ``gated``: ``x``'s
    rows are ``[gate | up]`` (``2 * in`` wide) and the input is ``silu(gate) * up``. ``residual`` ``[rows, out]``: added
    to the output (``residual + x @ weight.T + bias``). ``rotary`` (cos, sin with its first half negated, both
    ``[rows, dim]``; heads): the first ``heads`` heads of ``dim`` outputs of each row turned as transformers' rotary
    embedding turns them. Every row's operations depend on that row alone, as in :func:`linear`."""
    library = _LIBRARY[0] if _LIBRARY else _library()
    assert library is not None, "pack() first"
    run = library.ead_rows_fused_bf16 if packed.dtype == torch.int16 else library.ead_rows_fused
    x = x.contiguous()
    rows, width = x.shape
    k = width // 2 if gated else width
    if residual is not None:
        if residual.shape != (rows, out_features):
            raise ValueError(f"the residual must be [{rows}, {out_features}], got {list(residual.shape)}")
        residual = residual.contiguous()
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"the norm's weight must be [{k}], got {list(norm[0].shape)}")
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if not rows:
        return out
    cos = sin = None
    heads = dim = 0
    if rotary is not None:
        cos, sin, heads = rotary
        cos, sin = cos.contiguous(), sin.contiguous()
        dim = cos.shape[-1]
        if dim > ROTARY_MAX_DIM or dim % 2:
            raise ValueError(f"the kernel turns heads of an even width up to {ROTARY_MAX_DIM}, got {dim}")
        if cos.shape != (rows, dim) or sin.shape != (rows, dim) or heads * dim > out_features:
            raise ValueError(f"cos and sin must be [{rows}, {dim}] and turn at most {out_features // dim} heads")
    status = run(
        x.data_ptr(),
        rows,
        k,
        None if norm is None else norm[0].contiguous().data_ptr(),
        0.0 if norm is None else norm[1],
        int(gated),
        packed.data_ptr(),
        out_features,
        None if bias is None else bias.contiguous().data_ptr(),
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
        None if cos is None else cos.data_ptr(),
        None if sin is None else sin.data_ptr(),
        heads,
        dim,
        torch.get_num_threads(),
    )
    if status:
        raise MemoryError(f"the kernel could not allocate its scratch for {rows} rows of {k}")
    return out


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    meta: torch.Tensor,
    block: int,
    scale: float,
) -> torch.Tensor:
    """Each query token's attention over its own row's keys where the paged cache holds them -> ``[N, H, D]``.

    ``query`` ``[N, H, D]`` float32 (any strides over tokens and heads, each head's ``D`` values contiguous);
    ``keys``, ``values``: one layer's storage ``[Hkv, capacity, D]`` (contiguous float32); ``tables``: the rows' block
    tables one after another (int64); ``meta`` ``[N, 3]`` int64: where the token's row table starts in ``tables``, how
    many positions it sees (``0..n-1``), and a slot it sees after them (a sibling's own keys) or -1. The token's
    numbers depend on its query and its keys alone (see ``ead_attend`` in ``rows.c``)."""
    library = _LIBRARY[0] if _LIBRARY else _library()
    assert library is not None, "the kernel is not available here"
    tokens, heads, dim = query.shape
    if query.stride(2) != 1:
        query = query.contiguous()
    keys, values, tables, meta = (t.contiguous() for t in (keys, values, tables, meta))
    out = torch.empty((tokens, heads, dim), dtype=torch.float32)
    status = library.ead_attend(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        tokens,
        heads,
        keys.shape[0],
        dim,
        keys.data_ptr(),
        values.data_ptr(),
        keys.shape[1],
        block,
        tables.data_ptr(),
        tables.numel(),
        meta.data_ptr(),
        scale,
        out.data_ptr(),
    )
    if status == -2:
        raise RuntimeError(
            f"a query's block table runs past the tables given or the cache's {keys.shape[1]} slots (nothing read)"
        )
    if status:
        raise MemoryError(f"the attention kernel could not allocate its scratch for {tokens} queries")
    return out


class Layer(ctypes.Structure):
    """One decoder layer as :func:`layers` reads it (``struct ead_layer`` in ``rows.c``): addresses of its norms'
    weights, its projections packed by :func:`pack` (float32) and their biases (or None), and its MLP's width."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("qkv", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("gate_up_bias", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("intermediate", ctypes.c_int64),
    ]


def layers(
    table: ctypes.Array[Layer],
    hidden: torch.Tensor,
    shape: tuple[int, int, int],
    turn: tuple[torch.Tensor, torch.Tensor],
    storage: list[tuple[torch.Tensor, torch.Tensor]],
    slots: torch.Tensor,
    attend: tuple[torch.Tensor, torch.Tensor, int, float],
) -> None:
    """A model's decoder layers ``table`` over ``hidden`` ``[T, hidden]`` (contiguous float32, replaced by the last
    layer's output) in one call, for tokens that each attend as a decode step (:func:`attend`'s ``tables``, ``meta``,
    ``block`` and ``scale``): each layer's :func:`fused` projections, its new keys and values written at ``slots``
    ``[T]`` (flat slots of ``storage``, each layer's ``[Hkv, capacity, D]`` keys and values) and :func:`attend`, as
    the calls one by one would run them: the same bits. ``shape``: heads, key heads, head width; ``turn``: cos and
    signed sin ``[T, D]``."""
    library = _LIBRARY[0] if _LIBRARY else _library()
    assert library is not None, "the kernel is not available here"
    heads, kv_heads, dim = shape
    cos, sin = turn
    tables, meta, block, scale = attend
    tokens, width = hidden.shape
    capacity = storage[0][0].shape[1] if storage else 0
    stored = (kv_heads, capacity, dim)
    # what the kernel reads past, it must hold: every shape and layout checked (a few microseconds a pass)
    if (
        len(storage) != len(table)
        or any(t.shape != stored or not _plain(t, torch.float32) for pair in storage for t in pair)
        or not _plain(hidden, torch.float32)
        or any(t.shape != (tokens, dim) or not _plain(t, torch.float32) for t in (cos, sin))
        or slots.shape != (tokens,)
        or meta.numel() != 3 * tokens
        or not all(_plain(t, torch.int64) for t in (slots, tables, meta))
    ):
        raise ValueError(
            f"layers() takes {len(table)} layers' contiguous float32 storage {list(stored)} and, for {tokens} tokens, "
            f"contiguous float32 cos and sin [{tokens}, {dim}], int64 slots [{tokens}], tables and meta ({tokens} x 3)"
        )
    keys = (ctypes.c_void_p * len(storage))(*(k.data_ptr() for k, _ in storage))
    values = (ctypes.c_void_p * len(storage))(*(v.data_ptr() for _, v in storage))
    status = library.ead_layers(
        table,
        len(table),
        keys,
        values,
        hidden.data_ptr(),
        tokens,
        width,
        heads,
        kv_heads,
        dim,
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        capacity,
        block,
        tables.data_ptr(),
        tables.numel(),
        meta.data_ptr(),
        scale,
        torch.get_num_threads(),
    )
    if status == -2:
        raise RuntimeError(f"a write slot or a query's block table lies outside the cache's {capacity} slots")
    if status:
        raise MemoryError(f"the kernel could not allocate its scratch for {tokens} tokens")


def _plain(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and tensor.is_cpu and tensor.is_contiguous()  # (is_cpu: no device object made)


def _rows_call(rows: torch.Tensor, name: str) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The library and ``rows`` as a per-row call over ``[B, V]`` float32 CPU rows reads them (each row contiguous);
    anything else is refused with what it got."""
    library = _LIBRARY[0] if _LIBRARY else _library()
    assert library is not None, "the kernel is not available here"
    if rows.dim() != 2 or rows.dtype != torch.float32 or rows.device.type != "cpu":
        raise ValueError(f"{name} takes [B, V] float32 CPU logits, got {rows.dtype} {tuple(rows.shape)}")
    return library, rows if rows.stride(1) == 1 else rows.contiguous()


def row_stats(logits: torch.Tensor, *, entropy: bool = True, best: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` ``[B, V]`` (float32, CPU, each row contiguous): the entropy in bits of its softmax
    (``[B]`` float32; -inf values count as probability 0) and its most likely id, the lowest among equal maxima
    (``[B]`` int64): a read of the row for its maximum, one up to the first id that holds it, one for the entropy's
    two sums (torch's operations read it and their temporaries six times). A row holding a NaN or +inf, or nothing
    above -inf, gets a NaN entropy and id -1 (the caller works it out its own way). An output not asked for is left
    empty. Every row's numbers depend on that row alone."""
    library, logits = _rows_call(logits, "row_stats")
    rows, vocab = logits.shape
    bits = torch.empty(rows if entropy else 0, dtype=torch.float32)
    ids = torch.empty(rows if best else 0, dtype=torch.int64)
    if rows and vocab:
        library.ead_row_stats(
            logits.data_ptr(),
            rows,
            vocab,
            logits.stride(0),
            bits.data_ptr() if entropy else None,
            ids.data_ptr() if best else None,
        )
    return bits, ids


def nucleus(
    scaled: torch.Tensor, top_p: torch.Tensor, rtol: float, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's nucleus floor over ``scaled`` ``[B, V]`` (float32 CPU values at most 0: temperature applied, the
    maximum at 0) -> ``[B]`` float32 (-inf where ``top_p`` is 1): the value whose strictly larger values weigh less
    than ``top_p * (1 - rtol)`` of the mass while those at or above it reach it (ties kept), as
    :func:`ead_llm.core.ops.nucleus_by_digits` finds it, without a sort. With ``u`` ``[B]`` (float64 uniforms), also a
    token per row ``[B]`` drawn by inverse CDF in token-id order over the kept tokens' weights. A row holding a NaN or
    a value above 0 gets a NaN floor and token -1 (the caller works it out its own way). Every row's numbers depend on
    that row alone."""
    library, scaled = _rows_call(scaled, "nucleus")
    rows, vocab = scaled.shape
    top_p = top_p.to(torch.float32).contiguous()
    if top_p.shape != (rows,) or (u is not None and u.numel() != rows):
        raise ValueError(f"nucleus needs one top_p (and u) per row of {rows}")
    out = torch.empty(rows, dtype=torch.float32)
    tokens = None if u is None else torch.empty(rows, dtype=torch.int64)
    draws = None if u is None else u.to(torch.float64).reshape(rows).contiguous()
    if rows and vocab:
        status = library.ead_nucleus(
            scaled.data_ptr(),
            rows,
            vocab,
            scaled.stride(0),
            top_p.data_ptr(),
            rtol,
            None if draws is None else draws.data_ptr(),
            out.data_ptr(),
            None if tokens is None else tokens.data_ptr(),
        )
        if status:
            raise MemoryError(f"the nucleus kernel could not allocate its scratch for a row of {vocab}")
    return out, tokens
