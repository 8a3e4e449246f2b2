"""ead-llm's own CPU projection kernel: a row's bits in any call, values to rounding, and every way it can be absent."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from ead_llm.core import fused_llama, kernels, ops
from ead_llm.core.fused_llama import NATIVE_BF16, Projection, candidates


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaNs included."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler, or a CPU without AVX2 and FMA")


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (15, 7), (16, 64), (17, 3), (100, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32", "bfloat16-weights"])
def test_a_row_gets_the_same_bits_in_every_call_and_f_linear_values_to_rounding(
    out_features: int, in_features: int, with_bias: bool, bfloat16: bool
) -> None:
    """Outputs past a panel's 16 columns (a row alone, or 2 to 4 float32 rows, run four whole panels at once, the rest
    one by one: 100 outputs are 4 + 3 panels), rows past the 6 a micro-kernel holds (in groups of even size: 7 rows as
    4 + 3, 13 as 5 + 5 + 3, the later groups fetching the next panel) and the 64 a block keeps: every row
    of a 130-row call equals itself called alone, in any slice and at any offset, with ties, signed zeros and
    infinities in the rows; a NaN stays in its own row. With bfloat16 weights (a draft's), the values are F.linear's
    on the weight rounded to bfloat16, to float32 rounding: the widening is exact."""
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(130, in_features, generator=gen).round(decimals=1)  # ties in the products
    x[3] = 0.0
    x[4] = -0.0
    x[5, 0] = float("inf")
    x[6, -1] = float("nan")
    packed = kernels.pack(weight, bfloat16=bfloat16)
    assert packed.dtype == (torch.int16 if bfloat16 else torch.float32)
    whole = kernels.linear(x, packed, out_features, bias)
    reference = weight.bfloat16().float() if bfloat16 else weight
    torch.testing.assert_close(whole[7:], F.linear(x[7:], reference, bias), rtol=1e-5, atol=1e-5)
    assert whole[6].isnan().all() and not whole[7:].isnan().any()
    slices = [
        (0, 1),
        (6, 7),
        (0, 3),
        (20, 24),
        (2, 9),
        (9, 17),
        (10, 23),
        (60, 70),
        (63, 65),
        (1, 130),
        (129, 130),
        (5, 69),
    ]
    for start, stop in slices:
        assert same_bits(kernels.linear(x[start:stop], packed, out_features, bias), whole[start:stop]), (start, stop)


@needs_kernel
def test_inputs_of_any_layout_and_an_empty_call() -> None:
    """A transposed (non-contiguous) input, the forward's ``[1, T, in]`` and zero rows; a weight the kernel cannot
    pack is refused with what to change."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(30, 20, generator=gen)
    packed = kernels.pack(weight)
    x = torch.randn(20, 5, generator=gen).t()
    assert not x.is_contiguous()
    assert torch.equal(kernels.linear(x, packed, 30, None), kernels.linear(x.contiguous(), packed, 30, None))
    assert kernels.linear(x[None], packed, 30, None).shape == (1, 5, 30)
    assert kernels.linear(torch.empty(0, 20), packed, 30, None).shape == (0, 30)
    for bad in (weight.bfloat16(), weight[0], weight.double()):
        with pytest.raises(ValueError, match="2-D float32 CPU weight"):
            kernels.pack(bad)


@needs_kernel
def test_a_projection_on_the_kernel_is_taken_with_no_padding() -> None:
    """The probe finds every row count agreeing (by construction): the projection runs calls of one row as one; on
    bfloat16 weights (a draft's products on a CPU without bfloat16 arithmetic) as well."""
    projection = Projection(torch.randn(48, 40), torch.randn(48), kernel="native")
    assert projection.kernel == "native" and projection.min_rows == 1
    x = torch.randn(3, 40)
    with torch.inference_mode():
        torch.testing.assert_close(projection(x), F.linear(x, projection.weight, projection.bias))
        assert projection.use(NATIVE_BF16) and projection.min_rows == 1
        rounded = F.linear(x, projection.weight.bfloat16().float(), projection.bias)
        torch.testing.assert_close(projection(x), rounded)
    if not fused_llama.bfloat16_native():
        assert fused_llama.draft_bfloat16_kernel() == NATIVE_BF16


def test_where_the_kernel_is_turned_off_torchs_kernels_run(tmp_path: Path) -> None:
    """``EAD_LLM_NATIVE_KERNEL=0``: not built, not a candidate, and a projection asked for it takes another."""
    code = (
        "import torch\n"
        "from ead_llm.core import kernels\n"
        "from ead_llm.core.fused_llama import NATIVE_BF16, Projection, candidates\n"
        "p = Projection(torch.randn(48, 40), None, kernel='native')\n"
        "print(kernels.available(), p.kernel, 'native' in candidates([p]))\n"
    )
    env = {"EAD_LLM_NATIVE_KERNEL": "0", "EAD_LLM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    available, kernel, candidate = done.stdout.split()
    assert available == "False" and kernel in ("onednn", "blas") and candidate == "False"
    assert not (tmp_path / "kernels").exists()


def test_a_compiler_that_fails_leaves_torchs_kernels_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No error reaches the caller: the kernel is unavailable, the log says why, and projections use torch's."""
    monkeypatch.setattr(kernels, "_LIBRARY", [])
    monkeypatch.setattr(kernels, "_supported", lambda: True)
    monkeypatch.setenv("EAD_LLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1, as a compiler that rejects the source does
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    with caplog.at_level(logging.WARNING, logger="ead_llm.core.kernels"):
        assert not kernels.available()
    assert "did not build" in caplog.text
    projection = Projection(torch.randn(48, 40), None, kernel="native")
    assert projection.kernel in ("onednn", "blas") and "native" not in candidates([projection])
    with pytest.raises(RuntimeError, match="not available"):
        kernels.pack(torch.randn(4, 4))
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half written left to load


@needs_kernel
def test_processes_building_it_at_once_each_load_a_whole_library(tmp_path: Path) -> None:
    """Four processes compile into one empty cache at the same time (parallel test workers, engines per process):
    each loads a library and computes the same bits."""
    code = (
        "import torch, hashlib\n"
        "from ead_llm.core import kernels\n"
        "w = torch.randn(50, 30, generator=torch.Generator().manual_seed(0))\n"
        "x = torch.randn(9, 30, generator=torch.Generator().manual_seed(1))\n"
        "out = kernels.linear(x, kernels.pack(w), 50, None)\n"
        "print(hashlib.sha256(out.numpy().tobytes()).hexdigest())\n"
    )
    env = {"EAD_LLM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env) for _ in "abcd"]
    digests = {run.communicate(timeout=300)[0].strip() for run in runs}
    assert all(run.returncode == 0 for run in runs)
    assert len(digests) == 1 and len(next(iter(digests))) == 64
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 40), (100, 130), (17, 3)])
@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32", "bfloat16-weights"])
def test_the_fused_projection_gives_a_layers_values_and_a_rows_bits_in_any_call(
    out_features: int, in_features: int, bfloat16: bool
) -> None:
    """A projection with its norm, with silu(gate) * up, with the residual added and with the rotary turn in the
    kernel's call: transformers' values to rounding, and every row of a 130-row call the bits it gets alone or in
    any slice (rows past a block of 64 included). A NaN stays in its own row."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    reference = weight.bfloat16().float() if bfloat16 else weight
    packed = kernels.pack(weight, bfloat16=bfloat16)
    norm = (torch.rand(in_features, generator=gen) + 0.5, 1e-5)
    x = torch.randn(130, in_features, generator=gen) * 3
    gate_up = torch.randn(130, 2 * in_features, generator=gen) * 4
    residual = torch.randn(130, out_features, generator=gen)
    x[6, 0] = float("nan")
    dim = 8
    heads = out_features // dim // 2
    angles = torch.rand(130, dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)  # signed: the first half negated

    def turned(y: torch.Tensor, rows: slice) -> torch.Tensor:
        y = y.clone()
        part = y[:, : heads * dim].view(-1, heads, dim)
        rolled = part.roll(dim // 2, -1)
        y[:, : heads * dim] = (part * cos[rows, None] + rolled * sin[rows, None]).reshape(-1, heads * dim)
        return y

    every = slice(0, 130)
    gated = F.silu(gate_up[:, :in_features]) * gate_up[:, in_features:]
    normed = F.linear(_rms_norm(x, *norm), reference, bias)
    cases = {
        "norm": (x, {"norm": norm}, normed),
        "gated": (gate_up, {"gated": True}, F.linear(gated, reference, bias)),
        "residual": (x, {"residual": residual}, residual + F.linear(x, reference, bias)),
        "rotary": (x, {"norm": norm, "rotary": (cos, sin, heads)}, turned(normed, every)),
    }
    for name, (inputs, options, want) in cases.items():
        whole = kernels.fused(inputs, packed, out_features, bias, **options)
        if name != "gated":  # a NaN in row 6's input: that row only (all of it where the norm sums it in)
            assert whole[6].isnan().all() if "norm" in options else whole[6].isnan().any()
            assert not torch.cat((whole[:6], whole[7:])).isnan().any()
        torch.testing.assert_close(whole, want, rtol=1e-4, atol=1e-4, equal_nan=True, msg=name)
        whole = kernels.fused(inputs, packed, out_features, bias, **options)
        for start, stop in [(0, 1), (7, 8), (2, 6), (2, 9), (60, 70), (129, 130), (5, 69)]:
            part = dict(options)
            if "residual" in part:
                part["residual"] = residual[start:stop]
            if "rotary" in part:
                part["rotary"] = (cos[start:stop], sin[start:stop], heads)
            got = kernels.fused(inputs[start:stop], packed, out_features, bias, **part)
            assert same_bits(got, whole[start:stop]), (name, start, stop)


@needs_kernel
def test_the_fused_projection_turns_heads_torch_turns_them_to_the_bit() -> None:
    """The rotary turn in the kernel is torch's elementwise form, product by product: the same bits."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 32, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    packed = kernels.pack(weight)
    cos, sin = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)
    plain = kernels.linear(x, packed, 64, None).view(5, 4, 16)
    want = plain * cos[:, None] + plain.roll(8, -1) * sin[:, None]
    got = kernels.fused(x, packed, 64, None, rotary=(cos, sin, 4)).view(5, 4, 16)
    assert same_bits(got, want)
    with pytest.raises(ValueError, match="even width"):
        kernels.fused(x, packed, 64, None, rotary=(cos[:, :15], sin[:, :15], 4))


def _attention_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """Plain attention of one token's heads ``[H, D]`` over ``slots`` of a layer's ``[Hkv, capacity, D]``."""
    group = query.shape[0] // keys.shape[0]
    k = keys[:, slots].double().repeat_interleave(group, dim=0)  # [H, L, D]
    v = values[:, slots].double().repeat_interleave(group, dim=0)
    weights = (query.double()[:, None] @ k.transpose(-1, -2) / query.shape[-1] ** 0.5).softmax(dim=-1)
    return (weights @ v)[:, 0].float()


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (2, 1, 12), (3, 1, 24), (2, 2, 80)])
def test_the_attention_kernel_reads_each_query_over_its_own_table_and_nothing_else(
    heads: int, kv_heads: int, dim: int
) -> None:
    """Queries of rows whose blocks lie scattered, one with a sibling's own slot after its positions, read where a
    cache stores them: plain attention's values, with every slot no query owns poisoned with NaN; each query's bits
    are the same alone as beside the others, and a query with strides (a view of a layer's q/k/v output) reads as
    a copy does. The rows see 3 to 37 positions: the kernel takes keys eight at a time, exponentials 32 at a time and
    a head's outputs 64, 32, 16 and 8 at a time, each with its own tail."""
    gen = torch.Generator().manual_seed(heads * dim)
    block, capacity = 4, 96
    keys = torch.full((kv_heads, capacity, dim), float("nan"))
    values = torch.full((kv_heads, capacity, dim), float("nan"))
    tables = [[7, 2, 9, 0, 20], [5, 6, 1], [11], [12, 13, 14, 15, 16, 17, 18, 19, 21, 22]]
    seen = [19, 10, 3, 37]  # positions each row's query sees
    own = [-1, 3 * block + 2, -1, -1]  # row 1 is a sibling: its own keys at a slot of block 3
    rows_slots = []
    for table, n, extra in zip(tables, seen, own, strict=True):
        slots = [table[p // block] * block + p % block for p in range(n)] + ([extra] if extra >= 0 else [])
        rows_slots.append(slots)
        for slot in slots:
            keys[:, slot] = torch.randn(kv_heads, dim, generator=gen)
            values[:, slot] = torch.randn(kv_heads, dim, generator=gen)
    flat, meta = [], []
    for table, n, extra in zip(tables, seen, own, strict=True):
        meta.extend((len(flat), n, extra))
        flat.extend(table)
    rows = len(tables)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    query = qkv[:, : heads * dim].view(rows, heads, dim)  # strided over tokens
    flat_t, meta_t = torch.tensor(flat), torch.tensor(meta).view(rows, 3)
    together = kernels.attend(query, keys, values, flat_t, meta_t, block, dim**-0.5)
    assert together.shape == (rows, heads, dim) and not together.isnan().any()
    for t in range(rows):
        want = _attention_reference(query[t], keys, values, rows_slots[t])
        torch.testing.assert_close(together[t], want, rtol=1e-5, atol=1e-5)
        alone = kernels.attend(query[t : t + 1].contiguous(), keys, values, flat_t, meta_t[t : t + 1], block, dim**-0.5)
        assert same_bits(alone, together[t : t + 1])
    steep = kernels.attend(query * 60, keys, values, flat_t, meta_t, block, dim**-0.5)  # scores far past exp's range
    for t in range(rows):
        torch.testing.assert_close(steep[t], _attention_reference(query[t] * 60, keys, values, rows_slots[t]))


@needs_kernel
def test_the_attention_kernel_refuses_a_table_past_the_storage_and_reads_nothing() -> None:
    """A block table naming a slot past the layer's storage (as a cache cleared under a running pass would leave
    it), or a query whose table runs past the tables given, raises instead of reading outside the storage."""
    keys = values = torch.zeros(2, 16, 8)
    query = torch.zeros(1, 2, 8)
    good = kernels.attend(query, keys, values, torch.tensor([3]), torch.tensor([[0, 4, -1]]), 4, 1.0)
    assert good.shape == (1, 2, 8)
    bad = (([4], [0, 4, -1]), ([1], [0, 5, -1]), ([1], [0, 3, 16]), ([1], [1, 2, -1]), ([1], [-1, 2, -1]))
    for tables, meta in bad:
        with pytest.raises(RuntimeError, match="runs past"):
            kernels.attend(query, keys, values, torch.tensor(tables), torch.tensor([meta]), 4, 1.0)
    weight = kernels.pack(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="residual"):
        kernels.fused(torch.zeros(2, 8), weight, 8, None, residual=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.fused(torch.zeros(2, 8), weight, 8, None, rotary=(torch.zeros(1, 8), torch.zeros(1, 8), 1))


def float64_entropy_bits(rows: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(rows.double(), dim=-1)
    return -torch.where(torch.isinf(logp), 0.0, logp.exp() * logp).sum(-1) / torch.log(torch.tensor(2.0)).double()


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 511, 513, 1030, 49152])
def test_row_stats_entropy_to_float64_and_the_first_of_equal_maxima(vocab: int) -> None:
    """Rows shorter than a lane, past a 512-value block, and a real vocabulary: the entropy within 1e-5 bits of a
    float64 one (masked values counting as 0), and the most likely id torch's rule gives, with the maximum tied at
    several places (the tail's lanes too)."""
    gen = torch.Generator().manual_seed(vocab)
    rows = (torch.randn(6, vocab, generator=gen) * torch.tensor([[0.1], [1.0], [3.0], [10.0], [30.0], [1.0]])).float()
    rows[5, :: max(1, vocab // 5)] = rows[5].max() + 1.0  # the maximum at every fifth position...
    rows[4, torch.arange(vocab) % 3 == 1] = -torch.inf  # ...and a third of a row masked
    rows[3, -1] = rows[3].max()  # the last value ties the first maximum
    bits, ids = kernels.row_stats(rows)
    assert torch.allclose(bits.double(), float64_entropy_bits(rows), atol=1e-5, rtol=1e-6)
    assert torch.equal(ids, rows.max(dim=-1).indices) and (bits >= 0).all()


@needs_kernel
def test_row_stats_leaves_nan_infinite_and_empty_rows_to_torch_and_ops_decides_them_as_before() -> None:
    """A row with a NaN or +inf, or all -inf, is marked (NaN, -1); ``entropy_bits`` and ``best`` give torch's answer for
    those rows and the kernel's for the others, which stay where they are. One certain token: 0 bits exactly."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor(
        [[0.0, -inf, -inf, 1.0], [nan, 0.0, 1.0, 2.0], [1.0, inf, 0.0, inf], [-inf] * 4, [0.0, -inf, -inf, -inf]]
    )
    bits, ids = kernels.row_stats(rows)
    assert torch.isnan(bits[1:4]).all() and ids[1:4].tolist() == [-1, -1, -1]
    assert bits[4].item() == 0.0 and ids[4].item() == 0
    torch_bits, torch_ids = ops._entropy_bits(rows), rows.max(dim=-1).indices
    mine_bits, mine_ids = ops.entropy_bits(rows), ops.best(rows)
    assert same_bits(mine_bits[1:4], torch_bits[1:4]) and torch.equal(mine_ids, torch_ids)
    assert same_bits(mine_bits[[0, 4]], bits[[0, 4]])
    assert torch.allclose(mine_bits[[0, 4]], torch_bits[[0, 4]], atol=1e-6)


@needs_kernel
def test_row_stats_a_row_has_the_same_bits_alone_in_any_batch_and_through_a_strided_view() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(40, 1100, generator=gen) * 4
    rows = wide[:, 50:1080]  # rows 1100 apart in memory
    bits, ids = kernels.row_stats(rows)
    for start, stop in [(0, 1), (7, 8), (3, 29), (0, 40)]:
        part_bits, part_ids = kernels.row_stats(rows[start:stop].clone())
        assert same_bits(part_bits, bits[start:stop]) and torch.equal(part_ids, ids[start:stop])
    assert same_bits(ops.entropy_bits(rows[None]), bits[None])  # [..., V] inputs keep their leading shape
    assert torch.equal(ops.best(rows[None]), ids[None])


@needs_kernel
def test_row_stats_refuses_what_it_cannot_read() -> None:
    for bad in (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3), torch.zeros(2, 3, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="float32 CPU logits"):
            kernels.row_stats(bad)


def torch_floor(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int) -> torch.Tensor:
    return ops.kept_floor(scaled, top_k, top_p, max_top_k=max_top_k, any_top_p=True, native=False).floor


def filtered(scaled: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """What a floor leaves of ``scaled`` (as ``filter_logits`` applies it): two floors that keep the same tokens
    give the same bits (-0.0 and 0.0 as a floor, or the row's least value and -inf, keep the same)."""
    return scaled.masked_fill(scaled < floor[:, None], -torch.inf)


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 5, 9, 3000, 20000])
def test_nucleus_floor_is_torch_searchs_to_the_bit_flat_peaked_tied_and_cut_by_top_k(vocab: int) -> None:
    """Rows whose nucleus lies among a few tokens or reaches over most of the row, a top-k cut inside a tie, masked
    values, a temperature that leaves one token: the kernel's floor is the torch search's (the sampler's and the
    verifier's filter take it, so they keep the same tokens). With top-k on some rows, those rows take torch's
    search and the others the kernel's, in the same call."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen) * torch.tensor(
        [[0.01], [0.3], [1.0], [3.0], [30.0], [1.0], [1.0], [1]]
    )
    logits[5] = logits[5].round(decimals=0)  # wide ties
    logits[6, ::3] = -torch.inf
    temperature = torch.tensor([0.9, 1.0, 0.7, 1.3, 1.0, 1.0, 0.5, 1e-30])[:, None]
    scaled = ops.apply_temperature(logits, temperature)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.3, 0.99, 0.8, 0.6, 0.9])
    for top_k, max_top_k in [(torch.zeros(8, dtype=torch.int64), 0), (torch.tensor([0, 3, 50, 0, 7, 2, 0, 1]), 50)]:
        mine = ops.kept_floor(scaled, top_k, top_p, max_top_k=max_top_k, any_top_p=True).floor  # kernel: no top-k
        assert same_bits(filtered(scaled, mine), filtered(scaled, torch_floor(scaled, top_k, top_p, max_top_k)))


@needs_kernel
def test_nucleus_edge_that_falls_exactly_on_a_token_is_decided_by_the_rule_not_rounding() -> None:
    """0.5 + 0.3 of the mass at top_p 0.8: the third token's strictly earlier mass reaches top_p (within the
    tolerance), so it is dropped with the token tied to it; at 0.81 both are kept. A tie group whose earlier mass (0.4)
    is below top_p is kept whole (0.8, 0.5), and dropped whole once that mass reaches it (0.4)."""
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.4, 0.2, 0.2, 0.2]])
    scaled = ops.apply_temperature(torch.log(probs), 1.0)
    for p, kept in [(0.8, [2, 4]), (0.81, [4, 4]), (0.5, [1, 4]), (0.4, [1, 1])]:
        floor, _ = ops.native_nucleus(scaled, torch.full((2,), p))
        assert (scaled >= floor[:, None]).sum(-1).tolist() == kept, p
        theirs = torch_floor(scaled, torch.zeros(2, dtype=torch.int64), torch.full((2,), p), 0)
        assert same_bits(filtered(scaled, floor), filtered(scaled, theirs))


@needs_kernel
@pytest.mark.parametrize("top_p", [0.9, 1.0], ids=["nucleus", "every-token"])
def test_nucleus_draws_follow_the_filtered_distribution_in_token_order_row_by_row(top_p: float) -> None:
    """Evenly spaced uniforms give each kept token its share of the draws (to one draw), in token-id order, nothing
    outside the kept set (at top-p 1, every token: the sampler's temperature-only rows); a row's draw is the same
    alone and in a batch."""
    logits = torch.log(torch.tensor([0.05, 0.3, 0.02, 0.25, 0.38]))
    scaled = ops.apply_temperature(logits[None], 1.0)
    count = 1000
    u = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    rows = scaled.expand(count, -1).contiguous()
    _, drawn = ops.native_nucleus(rows, torch.full((count,), top_p), u=u[:, None])
    assert drawn is not None
    probs = ops.filtered_probs(
        logits[None],
        torch.ones(1),
        torch.zeros(1, dtype=torch.int64),
        torch.full((1,), top_p),
        max_top_k=0,
        any_top_p=top_p < 1.0,
    )[0]
    shares = torch.bincount(drawn, minlength=5).double() / count
    assert torch.allclose(shares, probs.double(), atol=1.5 / count)
    assert (shares[[0, 2]].sum() == 0) == (top_p < 1.0)
    assert torch.equal(drawn, drawn.sort().values)  # u ascending, tokens ascending: the CDF runs in id order
    for b in (0, 437, 999):
        _, alone = ops.native_nucleus(rows[b : b + 1], torch.full((1,), top_p), u=u[b : b + 1, None])
        assert alone is not None and int(alone) == int(drawn[b])


@needs_kernel
def test_nucleus_leaves_nan_rows_to_torch_and_the_sampler_still_draws_them() -> None:
    from ead_llm.core.sampler import SamplingMetadata, sample, stream_key

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(5))
    logits[1, 7] = float("nan")
    scaled = ops.apply_temperature(logits, 0.8)
    floor, tokens = kernels.nucleus(
        scaled,
        torch.full((3,), 0.9),
        ops.NUCLEUS_RTOL,
        torch.rand(3, dtype=torch.float64),
    )
    assert (
        torch.isnan(floor[1]) and tokens is not None and int(tokens[1]) == -1 and not torch.isnan(floor[[0, 2]]).any()
    )
    meta = SamplingMetadata.build([(0.8, 0, 0.9, stream_key(4, b), 2) for b in range(3)])
    mine = sample(logits, meta)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "on_kernel", lambda x: False)
        theirs = sample(logits, meta)
    assert int(mine[1]) == int(theirs[1])  # the NaN row: torch's floor and draw, as without the kernel


@needs_kernel
def test_a_greedy_passs_entropy_and_token_come_from_one_read_with_each_functions_bits() -> None:
    """The sampler's greedy pass asks the kernel for a row's entropy and most likely id at once: the same bits as
    ``entropy_bits`` and ``best`` apart, ties to the lowest id, rows with a NaN, +inf or nothing above -inf decided
    by torch as those functions decide them; and one call, not two."""
    from ead_llm.core.sampler import GREEDY, Sampler

    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(8))
    logits[1, [40, 2000]] = 9.0  # a tie: the lower id
    logits[2, 5] = float("nan")
    logits[3, 9] = float("inf")
    logits[4] = -torch.inf
    calls: list[tuple[bool, bool]] = []
    row_stats = kernels.row_stats

    def counted(rows: torch.Tensor, *, entropy: bool = True, best: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((entropy, best))
        return row_stats(rows, entropy=entropy, best=best)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "row_stats", counted)
        out = Sampler()(logits, GREEDY)
    assert calls == [(True, True)]
    assert torch.equal(out.tokens, ops.best(logits)) and int(out.tokens[1]) == 40
    torch.testing.assert_close(out.entropy_bits, ops.entropy_bits(logits), rtol=0, atol=0, equal_nan=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "on_kernel", lambda x: False)  # torch's formula and rule for every row
        torch.testing.assert_close(out.entropy_bits[[2, 3, 4]], ops.entropy_bits(logits[[2, 3, 4]]), equal_nan=True)
        assert torch.equal(out.tokens[[2, 3, 4]], ops.best(logits[[2, 3, 4]]))


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32", "bfloat16-weights"])
def test_a_rows_bits_are_the_same_on_one_thread_or_several(bfloat16: bool) -> None:
    """torch's threads share a call's panels out (whole panels: each output is still one chain on one thread), so a
    row gets the same bits on 1, 2 or 3 threads, in calls of 1 to 70 rows, with the fused call's norm, gate, residual
    and rotary turn."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 64, generator=gen)  # 13 panels
    packed = kernels.pack(weight, bfloat16=bfloat16)
    x = torch.randn(70, 64, generator=gen)
    gate_up = torch.randn(70, 128, generator=gen)
    residual = torch.randn(70, 200, generator=gen)
    angles = torch.rand(70, 4, generator=gen)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    calls = {
        "linear": lambda rows: kernels.linear(x[rows], packed, 200, None),
        "norm, rotary": lambda rows: kernels.fused(
            x[rows], packed, 200, None, norm=(torch.ones(64), 1e-5), rotary=(cos[rows], sin[rows], 3)
        ),
        "gated, residual": lambda rows: kernels.fused(
            gate_up[rows], packed, 200, None, gated=True, residual=residual[rows]
        ),
    }
    for name, call in calls.items():
        for rows in (slice(0, 1), slice(3, 7), slice(3, 10), slice(0, 13), slice(0, 70)):
            with _threads(1):
                alone = call(rows)
            for count in (2, 3):
                with _threads(count):
                    assert same_bits(call(rows), alone), (name, rows, count)


def _forked_linear(packed: torch.Tensor, x: torch.Tensor, out: Any) -> None:
    torch.set_num_threads(2)
    out.put(kernels.linear(x, packed, 200, None).tolist())


@needs_kernel
def test_a_process_forked_after_threaded_calls_runs_the_kernel_on_one_thread() -> None:
    """A child forked after the parent ran the kernel on two threads has none of the parent's helper threads (it
    would wait for them forever): it runs its calls on one thread, with the same bits (a hang fails on the timeout)."""
    gen = torch.Generator().manual_seed(4)
    packed = kernels.pack(torch.randn(200, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    with _threads(2):
        want = kernels.linear(x, packed, 200, None)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_forked_linear, args=(packed, x, out))
    child.start()
    try:
        got = out.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert same_bits(torch.tensor(got), want)


@needs_kernel
def test_the_group_size_changes_no_bits() -> None:
    """A call of 1 to 13 rows gives every row the same bits with groups of at most 1 to 6 rows (float32 and bfloat16
    weights, plain and fused with a residual), and a group size out of range is refused."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(72, 40, generator=gen)
    x = torch.randn(13, 40, generator=gen)
    residual = torch.randn(13, 72, generator=gen)
    was = kernels.group()
    try:
        for bfloat16 in (False, True):
            packed = kernels.pack(weight, bfloat16=bfloat16)
            for rows in range(1, 14):
                want = None
                for most in range(kernels.GROUP_MOST, 0, -1):
                    kernels.set_group(most)
                    assert kernels.group() == most
                    got = (
                        kernels.linear(x[:rows], packed, 72, None),
                        kernels.fused(x[:rows], packed, 72, None, residual=residual[:rows]),
                    )
                    if want is None:
                        want = got
                    assert all(same_bits(a, b) for a, b in zip(got, want, strict=True)), (bfloat16, rows, most)
    finally:
        kernels.set_group(was)
    for most in (0, kernels.GROUP_MOST + 1):
        with pytest.raises(ValueError, match="a group holds"):
            kernels.set_group(most)
    assert kernels.group() == was


@needs_kernel
def test_tune_group_keeps_the_default_unless_another_size_is_clearly_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first memory-bound model decides once per process: another group size only below the margin, a model
    smaller than PACK_MIN_BYTES never decides, and a model after the first keeps the choice."""
    gen = torch.Generator().manual_seed(12)
    big = [Projection(torch.randn(1024, 1024, generator=gen), None, kernel="native")]
    small = [Projection(torch.randn(64, 64, generator=gen), None, kernel="native")]
    assert big[0].kernel == "native" and small[0].kernel == "native"
    default, other = fused_llama.GROUP_CHOICES
    was = kernels.group()
    timed: list[dict[int, float]] = []

    def fake_samples(work: dict[int, Any], repeats: int) -> dict[int, float]:
        for call in work.values():
            call()  # each candidate's calls run under its own group size
        return timed.pop(0)

    monkeypatch.setattr(fused_llama, "_fastest_samples", fake_samples)
    try:
        for seconds, want in (({default: 1.0, other: 0.97}, default), ({default: 1.0, other: 0.9}, other)):
            monkeypatch.setattr(fused_llama, "_chosen_group", [])
            timed.append(seconds)
            assert fused_llama.tune_group(small) == kernels.group() == default  # too small to decide: not timed
            assert timed and fused_llama._chosen_group == []
            assert fused_llama.tune_group(big) == kernels.group() == want
            assert not timed
            assert fused_llama._chosen_group == [want]
            assert fused_llama.tune_group(big) == want  # decided: not timed again
    finally:
        kernels.set_group(was)
