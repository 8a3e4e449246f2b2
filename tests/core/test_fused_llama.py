"""The lean Llama forward's own arithmetic: the same bits as transformers' modules, and its projections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ead_llm.core import fused_llama, kernels
from ead_llm.core.fused_llama import (
    BF16_ROWS,
    BFLOAT16,
    KERNELS,
    ONEDNN,
    PACK_MIN_BYTES,
    PAD_MAX,
    PROBE_ROWS,
    TUNED_ROWS,
    Projection,
    RotaryTable,
    choose_kernel,
    choose_widths,
    cpu_name,
    first_kernel,
    kernel_key,
    kernel_record,
    rotary,
    signed_sin,
    tune_widths,
)
from ead_llm.core.sources import cache_lock

AVAILABLE = [k for k in KERNELS if (k != "onednn" or ONEDNN is not None) and (k != "native" or kernels.available())]


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


@pytest.mark.parametrize("kernel", AVAILABLE)
def test_projection_prepares_float32_cpu_weights_and_matches_f_linear_to_rounding(kernel: str) -> None:
    """Each kernel's prepared weights give F.linear's values to float32 rounding, with and without bias, for 0 to 70
    rows (a decode step, a verify pass, a prefill) and for the [1, T, hidden] inputs the forward hands it."""
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    for b in (None, bias):
        projection = Projection(weight, b, kernel=kernel)
        if projection.kernel != kernel:  # this machine's BLAS gives rows in small calls other bits: oneDNN instead
            assert kernel == "blas" and projection.kernel == "onednn"
        assert projection.packed is not None
        for rows in (0, 1, 2, 3, 5, 70):
            x = torch.randn(1, rows, 48, generator=gen)
            with torch.inference_mode():
                got = projection(x)
            assert got.shape == (1, rows, 96)
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("shape", [(200, 64), (64, 2048), (576, 1536), (1536, 256)])
def test_a_prepared_projection_gives_each_row_the_same_bits_whatever_rows_share_the_call(
    shape: tuple[int, int], kernel: str
) -> None:
    """Batch invariance: row i of a 64-row call equals row i computed with 1, 2, 3, 4, 7 or 33 rows (a prompt's
    logits must not depend on where it stands in a batch), for narrow inputs and for wide ones such as SmolLM2's
    down projection (1,536 inputs), where oneDNN on some CPUs (and BLAS on others, for every shape) runs a single row
    through another code path; with either kernel, where this machine's BLAS allows it at all."""
    gen = torch.Generator().manual_seed(2)
    out_features, in_features = shape
    weight, bias = torch.randn(shape, generator=gen) * 0.05, torch.randn(out_features, generator=gen)
    projection = Projection(weight, bias, kernel=kernel)
    x = torch.randn(64, in_features, generator=gen)
    if projection.kernel is None:  # refused: then this machine's BLAS does give rows in small calls other bits
        with torch.inference_mode():
            transposed = weight.t().contiguous()
            whole = torch.addmm(bias, x, transposed)
            assert any(
                not torch.equal(torch.addmm(bias, part, transposed), whole[:rows] if head else whole[-rows:])
                for rows in PROBE_ROWS[1:]
                for head, part in ((True, x[:rows]), (False, x[-rows:]))
            )
        return
    with torch.inference_mode():
        whole = projection(x)
        for rows in (1, 2, 3, 4, 7, 33):
            assert torch.equal(projection(x[:rows]), whole[:rows])
            assert torch.equal(projection(x[-rows:]), whole[-rows:])
        assert torch.equal(projection(x[None, 5:6])[0], whole[5:6])  # one row as the fused pass sends it


def bfloat16_rows_agree(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether oneDNN's bfloat16 product (weight packed for one row) gives each of 64 rows the same bits alone and in
    calls of 2 to 64 rows: what a :data:`BFLOAT16` projection needs, asked of oneDNN directly."""
    assert ONEDNN is not None, "the CPU build of torch this project pins ships oneDNN"
    linear, pack = ONEDNN
    try:
        packed = pack(weight.detach().to(torch.bfloat16), 1)
    except RuntimeError:  # no bfloat16 path in this CPU's oneDNN at all (it wants AVX-512 or AVX-NE-CONVERT)
        return False
    low = None if bias is None else bias.detach().to(torch.bfloat16)
    x = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = linear(x, packed, low, "none", [], "")
    alone = all(torch.equal(linear(x[r : r + 1], packed, low, "none", [], ""), whole[r : r + 1]) for r in range(64))
    return alone and all(torch.equal(linear(x[:n], packed, low, "none", [], ""), whole[:n]) for n in range(2, 65))


@pytest.mark.parametrize("shape", [(576, 1536), (40, 24)], ids=["wide-input", "narrow"])
def test_a_bfloat16_projection_gives_each_row_the_same_bits_in_any_call_near_float32s(shape: tuple[int, int]) -> None:
    """A draft's bfloat16 products: a row's bits are the same whatever rows share its call, more than
    :data:`BF16_ROWS` included (oneDNN takes another path for larger calls, so they run in pieces); the results are
    float32, within bfloat16's rounding of F.linear's and not equal to them. Where this CPU's oneDNN would give a
    row other bits in another call, the projection refuses and keeps its kernel."""
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(shape, generator=gen) * 0.05, torch.randn(shape[0], generator=gen)
    projection = Projection(weight, bias, kernel="onednn")
    before = projection.kernel
    assert ONEDNN is not None, "the CPU build of torch this project pins ships oneDNN"
    x = torch.randn(2 * BF16_ROWS + 22, shape[1], generator=gen)
    with torch.inference_mode():
        if not projection.use(BFLOAT16):
            assert projection.kernel == before  # refused, and justly: some call of up to 64 rows differs
            assert not bfloat16_rows_agree(weight, bias)
            return
        assert projection.kernel == BFLOAT16
        whole = projection(x)
        assert whole.dtype == torch.float32
        for rows in (1, 2, 3, 5, 17, 63, BF16_ROWS, BF16_ROWS + 1, 100, len(x)):
            assert torch.equal(projection(x[:rows]), whole[:rows])
            assert torch.equal(projection(x[-rows:]), whole[-rows:])
        assert torch.equal(projection(x[None, 5:6])[0], whole[5:6])
        exact = F.linear(x, weight, bias)
        assert not torch.equal(whole, exact)
        assert (whole - exact).abs().max() <= 0.02 * exact.abs().max()
        assert projection.use(before) and torch.equal(projection(x), Projection(weight, bias, kernel=before)(x))


def test_a_projection_refuses_bfloat16_where_a_rows_bits_would_follow_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A projection refuses bfloat16 where its probe finds a row's bits follow its call, keeping its kernel; a second
    projection of the same shape is then refused from that probe, without packing a copy or probing again."""
    projection, other = (Projection(torch.randn(8, 4), None, kernel="onednn") for _ in "ab")
    packed = projection.packed
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    assert fused_llama.ONEDNN is not None
    monkeypatch.setattr(fused_llama, "ONEDNN", (fused_llama.ONEDNN[0], lambda weight, rows: weight))  # any CPU
    probes: list[int] = []
    monkeypatch.setattr(Projection, "_agreeing_from", lambda self, counts: probes.append(1) or 34)  # 33 rows differ
    assert projection.use(BFLOAT16) is False
    assert projection.kernel == "onednn" and projection.packed is packed
    assert fused_llama.ONEDNN is not None
    monkeypatch.setattr(fused_llama, "ONEDNN", (fused_llama.ONEDNN[0], lambda *args: pytest.fail("packed again")))
    assert other.use(BFLOAT16) is False and other.kernel == "onednn"
    assert probes == [1]


def test_a_projection_takes_the_next_kernel_where_its_first_gives_rows_other_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where BLAS gives a row other bits in calls of more rows than padding may add (differing up to 7 rows, against
    :data:`PAD_MAX`), a projection asked for it runs on oneDNN, whose rows agree, rather than on F.linear, whose rows
    do not either."""
    assert fused_llama.ONEDNN is not None
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    monkeypatch.setattr(
        Projection, "_agreeing_from", lambda self, counts: 8 if self.kernel == "blas" else 1
    )  # BLAS's rows differ up to 7 rows, oneDNN's agree
    projection = Projection(torch.randn(16, 8), None, kernel="blas")
    assert projection.kernel == "onednn" and projection.packed is not None
    monkeypatch.setattr(Projection, "_agreeing_from", lambda self, counts: 34)  # neither agrees
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    assert Projection(torch.randn(16, 8), None, kernel="blas").kernel is None  # F.linear, the last resort


def test_a_kernel_whose_rows_agree_from_a_few_on_is_taken_with_smaller_calls_padded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that gives rows in calls of 1 to 3 other bits and agrees from 4 on (an AMD Zen 3's MKL) is taken:
    calls of fewer rows run as 4 (copies of the last row), so each row gets its bits among 64 in every call, and
    tuning times them as they run (that call once). One that differs up to :data:`PAD_MAX` rows and more is refused."""
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    calls: list[int] = []

    def few_rows_differ(self: Projection, x: torch.Tensor) -> torch.Tensor:  # a stand-in BLAS, exact from 4 rows
        flat = x.reshape(-1, x.shape[-1])
        calls.append(flat.shape[0])
        out = flat @ self.weight.t() + (0.5 if flat.shape[0] < 4 else 0.0)
        return out.view(*x.shape[:-1], out.shape[-1])

    monkeypatch.setattr(Projection, "_packed", few_rows_differ)
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(16, 8, generator=gen)
    projection = Projection(weight, None, kernel="blas")
    assert projection.kernel == "blas" and projection.min_rows == 4
    x = torch.randn(64, 8, generator=gen)
    with torch.inference_mode():
        whole = projection(x)
        for rows in (1, 2, 3, 4, 5, 33):
            calls.clear()
            assert torch.equal(projection(x[:rows]), whole[:rows]) and torch.equal(projection(x[-rows:]), whole[-rows:])
            assert calls == [max(rows, 4)] * 2
        assert torch.equal(projection(x[None, 5:6])[0], whole[5:6])
        calls.clear()
        tune_widths([projection], repeats=1)
        assert min(calls) == 4
        seconds = fused_llama._time_rows([projection], 1)  # calls of 1 to 3 rows are the 4-row call, timed once
        assert seconds[1] == seconds[2] == seconds[3] == seconds[4]
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    monkeypatch.setattr(
        Projection,
        "_packed",
        lambda self, x: x @ self.weight.t() + (0.5 if x.reshape(-1, x.shape[-1]).shape[0] <= PAD_MAX else 0.0),
    )
    assert Projection(weight, None, kernel="blas").kernel != "blas"


def test_bfloat16_is_refused_where_this_cpus_onednn_cannot_pack_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX-512 or AVX-NE-CONVERT has no oneDNN bfloat16 path (packing raises): the projection refuses,
    keeps its kernel, and another of the same shape is refused without trying again."""
    projection = Projection(torch.randn(8, 4), None, kernel="onednn")
    kernel, packed = projection.kernel, projection.packed
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    assert fused_llama.ONEDNN is not None
    tries: list[int] = []

    def cannot(weight: torch.Tensor, rows: int) -> torch.Tensor:
        tries.append(rows)
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(fused_llama, "ONEDNN", (fused_llama.ONEDNN[0], cannot))
    assert projection.use(BFLOAT16) is False and projection.kernel == kernel and projection.packed is packed
    assert Projection(torch.randn(8, 4), None, kernel=None).use(BFLOAT16) is False
    assert tries == [1]


@pytest.mark.parametrize("kernel", AVAILABLE)
def test_a_projection_is_f_linear_exactly_under_autograd_in_bfloat16_or_unprepared(kernel: str) -> None:
    """Where it does not prepare (bfloat16, asked not to) or autograd is on, it is F.linear itself, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(32, 16, generator=gen), torch.randn(3, 16, generator=gen)
    assert torch.equal(Projection(weight, None, kernel=kernel)(x), F.linear(x, weight))  # autograd on
    assert Projection(weight, None, kernel=None).packed is None
    with torch.inference_mode():
        assert torch.equal(Projection(weight, None, kernel=None)(x), F.linear(x, weight))
        half = Projection(weight.bfloat16(), None, kernel=kernel)
        assert half.packed is None and torch.equal(half(x.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16()))
    with pytest.raises(ValueError, match="kernel must be one of"):
        Projection(weight, None, kernel="mkl")


def test_the_first_kernel_is_blas_below_the_cache_and_onednn_past_it_float32_on_cpu_only() -> None:
    """A model whose weights stay in cache starts on BLAS (oneDNN's fixed cost per call does not pay); one past
    PACK_MIN_BYTES on oneDNN where torch has it; bfloat16 runs F.linear."""
    assert first_kernel(torch.nn.Linear(8, 8)) == "blas"
    big = torch.nn.Linear(1024, PACK_MIN_BYTES // 4096 + 1)
    assert first_kernel(big) == ("onednn" if ONEDNN is not None else "blas")
    assert first_kernel(big.to(torch.bfloat16)) is None


def test_widths_send_a_call_as_the_fastest_row_count_at_least_its_own() -> None:
    """From the medians per row count: a call goes as more rows only when those beat its own time by the margin."""
    seconds = {1: 40.0, 2: 47.5, 3: 34.8, 4: 32.6, 5: 32.2, 6: 33.0, 7: 39.7, 8: 41.7}
    assert choose_widths(seconds) == (0, 5, 5, 3, 4, 5, 6, 7, 8)  # 3 or 4 -> 5 saves 7% or 1%: kept
    assert choose_widths({1: 1.0, 2: 1.2, 3: 1.3}) == (0, 1, 2, 3)  # one row is cheapest: nothing moves
    assert choose_widths({1: 1.0, 2: 0.95}, margin=0.9) == (0, 1, 2)  # within the margin: noise does not move it


@pytest.mark.parametrize("shape", [(200, 64), (576, 1536)])
def test_rows_sent_as_more_rows_keep_their_bits(shape: tuple[int, int]) -> None:
    """Padding a call with copies of its last row changes no row's bits (one row alone too, where oneDNN would run
    it through another kernel) and returns only the call's own rows."""
    gen = torch.Generator().manual_seed(4)
    projection = Projection(torch.randn(shape, generator=gen) * 0.05, None, kernel="onednn")
    x = torch.randn(64, shape[1], generator=gen)
    with torch.inference_mode():
        whole = projection(x)
        projection.widths = (0, 6, 6, 5, 7)
        for rows in (1, 2, 3, 4, 5):
            got = projection(x[None, :rows])
            assert got.shape == (1, rows, shape[0])
            assert torch.equal(got[0], whole[:rows])


def test_tuning_again_times_the_calls_as_they_run_untuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuning times each row count as it runs before tuning (one row as two only where it must), so a second tuning
    measures what the first did, not the widths the first chose."""
    gen = torch.Generator().manual_seed(6)
    projections = [Projection(torch.randn(64, 2048, generator=gen), None, kernel="onednn") for _ in range(2)]
    monkeypatch.setattr(fused_llama, "_TUNED", {})  # time them here, whatever this process timed before
    seen: list[tuple[int, ...]] = []
    original = Projection._packed
    monkeypatch.setattr(Projection, "_packed", lambda self, x: seen.append(tuple(x.shape)) or original(self, x))
    for p in projections:
        p.widths = (0, 8, 8)
    tune_widths(projections, repeats=1)
    rows = sorted({shape[0] for shape in seen})
    assert rows == sorted({max(n, projections[0].min_rows) for n in range(1, TUNED_ROWS + 1)})


def test_packing_and_tuning_leave_the_callers_random_state_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading an engine must not move torch's global generator (a seeded user script draws what it drew before)."""
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    weight = torch.randn(64, 2048, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    tune_widths([Projection(weight, None, kernel="onednn")], repeats=1)
    assert torch.equal(torch.rand(3), expected)


def test_a_second_model_of_the_same_shapes_takes_the_widths_timed_for_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timed once per process for a set of shapes: the second engine on a model is not timed again."""
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    timings: list[int] = []
    monkeypatch.setattr(fused_llama, "_time_widths", lambda packed, repeats: timings.append(len(packed)) or (0, 3))
    gen = torch.Generator().manual_seed(8)
    first = [Projection(torch.randn(64, 48, generator=gen), None, kernel="onednn") for _ in range(2)]
    second = [Projection(torch.randn(64, 48, generator=gen), None, kernel="onednn") for _ in range(2)]
    assert tune_widths(first) == tune_widths(second) == (0, 3)
    assert timings == [2] and all(p.widths == (0, 3) for p in first + second)
    tune_widths([Projection(torch.randn(32, 48, generator=gen), None, kernel="onednn")])  # other shapes: timed
    assert timings == [2, 1]


def _onednn_projections(seed: int, count: int = 2) -> list[Projection]:
    assert ONEDNN is not None, "the CPU build of torch this project pins ships oneDNN"
    gen = torch.Generator().manual_seed(seed)
    return [Projection(torch.randn(96, 48, generator=gen), None, kernel="onednn") for _ in range(count)]


def _timings_favouring(kernel: str) -> Any:
    """A stand-in for the timing: ``kernel``'s products take half the other's at every row count."""
    return lambda packed, repeats: dict.fromkeys(range(1, TUNED_ROWS + 1), 1.0 if packed[0].kernel == kernel else 2.0)


def test_the_kernel_is_timed_once_per_machine_and_kept_so_every_process_computes_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The faster kernel is taken and recorded; a later choice (another process, another engine) on the same machine
    takes the record whatever its own timing says, so the same seed keeps giving the same text; without the record
    the timing decides again."""
    monkeypatch.setenv("EAD_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_llama, "_TUNED", {})  # the stand-in timings' widths stay in this test
    blas_allowed = Projection(torch.randn(96, 48), None, kernel="blas").kernel == "blas"
    monkeypatch.setattr(fused_llama, "_time_rows", _timings_favouring("blas"))
    first = _onednn_projections(1)
    want = "blas" if blas_allowed else "native" if kernels.available() else "onednn"  # ours wins a tie
    assert choose_kernel(first) == want and all(p.kernel == want for p in first)
    record = json.loads(kernel_record().read_text())
    assert [entry["kernel"] for entry in record.values()] == [want]
    monkeypatch.setattr(fused_llama, "_time_rows", _timings_favouring("onednn"))
    again = _onednn_projections(2)
    assert choose_kernel(again) == want and all(p.kernel == want for p in again)  # the record, not the timing
    kernel_record().unlink()
    assert choose_kernel(_onednn_projections(3)) == "onednn"


def test_a_choice_waits_for_one_under_way_elsewhere_and_takes_its_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """While another process holds the kernel lock (choosing for the same model), a choice here neither times nor
    returns; once that one has recorded its kernel and let go, this one takes the record, whatever its own timing
    would say. (Without the lock both would time and each keep its own choice: two processes, two texts.)"""
    import threading

    monkeypatch.setenv("EAD_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    timed: list[str] = []

    def stand_in(packed: list[Projection], repeats: int) -> dict[int, float]:
        timed.append(str(packed[0].kernel))
        return _timings_favouring("blas")(packed, repeats)

    checked = threading.Event()
    real_check = fused_llama._recorded_kernel

    def check(key: str) -> str | None:
        found = real_check(key)
        checked.set()
        return found

    monkeypatch.setattr(fused_llama, "_time_rows", stand_in)
    monkeypatch.setattr(fused_llama, "_recorded_kernel", check)
    mine = _onednn_projections(6)
    chosen: list[str | None] = []
    with cache_lock(fused_llama.KERNEL_LOCK):  # as another process choosing for this model would
        worker = threading.Thread(target=lambda: chosen.append(choose_kernel(mine)), daemon=True)
        worker.start()
        assert checked.wait(timeout=60)
        worker.join(timeout=0.3)
        assert worker.is_alive() and not timed and not chosen  # waiting, not timing
        kernel_record().write_text(json.dumps({kernel_key(mine): {"kernel": "onednn"}}))
    worker.join(timeout=60)
    assert chosen == ["onednn"] and not timed and all(p.kernel == "onednn" for p in mine)


def test_the_record_tells_apart_cpus_that_share_a_name() -> None:
    """Two CPUs a virtual machine names alike ("AMD EPYC": a Zen 3 and a Zen 4 here, on one disk in turn) get other
    record keys, so a kernel timed and probed on one is not taken on the other; the same CPU gets the same key."""
    zen3 = (
        "processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nstepping\t: 1\nflags\t\t: fpu avx2\n"
    )
    zen4 = zen3.replace("model\t\t: 1\n", "model\t\t: 17\n").replace("avx2", "avx2 avx512f avx512_bf16")
    second_core = zen3.replace("processor\t: 0", "processor\t: 1").replace("avx2", "avx2 avx512f")
    assert cpu_name(zen3) != cpu_name(zen4)
    assert cpu_name(zen3) != cpu_name(zen3.replace("avx2", "avx2 avx512f"))  # the same family and model, other flags
    assert cpu_name(zen3) == cpu_name(zen3 + "\n" + second_core)  # the first processor's block speaks for the CPU
    assert cpu_name(zen3).startswith("AMD EPYC (cpu family 25 model 1 stepping 1, flags ")
    assert cpu_name("") == cpu_name("flags\t: avx2\n")  # no model name: what platform says
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "model name" in cpuinfo.read_text():
        assert "(cpu family " in cpu_name()  # this machine's own file is read the same way


def test_a_record_that_cannot_be_written_leaves_the_choice_to_this_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A read-only or missing cache folder is no error: the kernel is chosen for this process."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("EAD_LLM_CACHE", str(blocker))
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    monkeypatch.setattr(fused_llama, "_time_rows", _timings_favouring("onednn"))
    assert choose_kernel(_onednn_projections(4)) == "onednn"
    assert not kernel_record().exists()


def test_projections_that_start_on_blas_are_timed_without_onednn_and_f_linear_ones_not_at_all(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A small model (BLAS from the start) is weighed against ead-llm's own kernel only where that builds, never
    against oneDNN (whose fixed cost a call it does not repay); a bfloat16 one (F.linear) keeps its kernel and times
    nothing."""
    monkeypatch.setenv("EAD_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    timed: list[str | None] = []
    favour_blas = _timings_favouring("blas")
    monkeypatch.setattr(
        fused_llama,
        "_time_rows",
        lambda packed, repeats: timed.append(packed[0].kernel) or favour_blas(packed, repeats),
    )
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    monkeypatch.setattr(Projection, "_agreeing_from", lambda self, counts: 1)  # BLAS taken on any CPU
    gen = torch.Generator().manual_seed(5)
    small = [Projection(torch.randn(16, 8, generator=gen), None, kernel="blas") for _ in range(2)]
    assert choose_kernel(small) == "blas" and all(p.kernel == "blas" for p in small)
    assert timed == (["blas", "native"] if kernels.available() else [])
    timed.clear()
    half = [Projection(torch.randn(16, 8, generator=gen).bfloat16(), None, kernel="onednn")]
    assert choose_kernel(half) is None and half[0].kernel is None and not timed


class _Rotary(torch.nn.Module):
    """transformers' LlamaRotaryEmbedding's arithmetic on a given frequency table (``rope_type`` as asked)."""

    def __init__(self, dim: int, rope_type: str = "default", jitter: bool = False) -> None:
        super().__init__()
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.rope_type, self.jitter, self.calls = rope_type, jitter, 0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.jitter and position_ids.shape[-1] == 1:  # a call alone computes other bits than among many
            cos = cos * (1 + 2**-20)
        return cos.to(x.dtype), sin.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_gives_the_modules_bits_at_every_position_and_grows(dtype: torch.dtype) -> None:
    """Indexing the table equals calling the module on the same positions, bit for bit, for positions spread over a
    pass and past the table's first length (it doubles), in the model's dtype; one table build per doubling."""
    module = _Rotary(32)
    table = RotaryTable(module)
    like = torch.zeros(1, 1, 8, dtype=dtype)
    for positions in (torch.tensor([0, 5, 6, 7]), torch.tensor([3]), torch.tensor([511, 1000, 2047, 2048, 2049])):
        length = int(positions.max()) + 1
        cos, sin = table(like, positions, length)
        want_cos, want_sin = module(like, positions[None])
        assert cos.dtype == dtype and cos.shape == (1, 1, len(positions), 32)
        assert torch.equal(cos, want_cos.unsqueeze(1)) and torch.equal(sin, signed_sin(want_sin.unsqueeze(1)))
    assert table.static and table.cos is not None and table.cos.shape[0] >= 2050


def test_a_rotary_module_that_rescales_or_disagrees_is_called_every_pass() -> None:
    """Dynamic rope types change their frequencies with the length, and a module whose single calls give other bits
    than the table (the check at build) is not tabled: each pass calls the module, as transformers does."""
    like, positions = torch.zeros(1, 1, 8), torch.tensor([4, 9])
    for module in (_Rotary(16, rope_type="dynamic"), _Rotary(16, jitter=True)):
        table = RotaryTable(module)
        cos, _ = table(like, positions, 10)
        before = module.calls
        cos, sin = table(like, positions, 10)
        assert not table.static and module.calls == before + 1
        want_cos, want_sin = module(like, positions[None])
        assert torch.equal(cos, want_cos.unsqueeze(1)) and torch.equal(sin, signed_sin(want_sin.unsqueeze(1)))


_CHOOSE_IN_A_PROCESS = """
import hashlib, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from ead_llm.core.fused_llama import FusedLlama
torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=8)
model = LlamaForCausalLM(config).eval()  # 14 MB of float32 weights: both kernels are candidates
fused = FusedLlama(model)
x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
with torch.inference_mode():
    out = torch.cat([p(x).flatten() for p in fused.projections if p.weight.shape[1] == 256])
print(fused.head.kernel, hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow  # about 35 s of real timing in three processes: the slow suite, which CI runs
def test_processes_on_one_machine_take_the_kernel_the_first_one_timed_and_compute_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two processes load the same model: the first times both kernels and records its choice, the second takes the
    record (whatever its own timing would say) and computes the same bits; a process that finds another record
    (another choice for this machine) follows it. Real timing, real processes."""
    import subprocess
    import sys

    monkeypatch.setenv("EAD_LLM_CACHE", str(tmp_path))

    def run() -> tuple[str, str]:
        done = subprocess.run([sys.executable, "-c", _CHOOSE_IN_A_PROCESS], capture_output=True, text=True, check=True)
        kernel, digest = done.stdout.split()
        return kernel, digest

    first = run()
    record = json.loads(kernel_record().read_text())
    assert [entry["kernel"] for entry in record.values()] == [first[0]] and first[0] in KERNELS
    assert run() == first
    usable = [k for k in AVAILABLE if Projection(torch.randn(768, 256), None, kernel=k).kernel == k]
    for other in (k for k in usable if k != first[0]):  # where this machine has a second kernel to record
        kernel_record().write_text(json.dumps({key: {"kernel": other} for key in record}))
        assert run()[0] == other


def test_the_kernel_chosen_by_timing_hands_its_widths_to_the_tuning_without_timing_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where a model's kernel was timed at load, the widths come from that timing: the products are not timed a
    second time for them."""
    monkeypatch.setenv("EAD_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    calls: list[str | None] = []
    seconds = {1: 4.0, 2: 2.0, **dict.fromkeys(range(3, TUNED_ROWS + 1), 3.0)}  # one row runs fastest as two
    monkeypatch.setattr(fused_llama, "_time_rows", lambda packed, repeats: calls.append(packed[0].kernel) or seconds)
    projections = _onednn_projections(6)
    chosen = choose_kernel(projections)
    timed = len(calls)
    assert chosen in calls  # (every kernel times alike here: ours where it builds, else oneDNN)
    assert tune_widths(projections) == choose_widths(seconds) and len(calls) == timed
    assert all(p.widths == choose_widths(seconds) for p in projections)


def test_our_kernel_is_kept_unless_another_runs_the_products_clearly_faster() -> None:
    """Ours also runs the layer's work around the products, which their timing does not count: another kernel is
    taken only when its products cost at most OWN_MARGIN of ours (a choice timed beside other work chose BLAS at 19.7
    against 20.8 ms and ran the embedded large model's decode forward 2.7x slower)."""
    assert fused_llama.fastest({"blas": 19.7, "native": 20.8, "onednn": 33.2}, "blas") == "native"
    assert fused_llama.fastest({"blas": 0.8 * 20.0, "native": 20.0}, "blas") == "blas"
    assert fused_llama.fastest({"blas": 5.0, "native": 4.0}, "blas") == "native"
    assert fused_llama.fastest({"blas": 5.0, "onednn": 4.0}, "onednn") == "onednn"  # ours absent: the cheapest
    assert fused_llama.fastest({}, "onednn") == "onednn"


def _tiny_llama(seed: int, hidden: int = 32, vocab: int = 64) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@pytest.mark.skipif(not kernels.available(), reason="weighs ead-llm's own kernel, which does not build here")
def test_a_models_kernel_is_timed_on_its_whole_passes_not_on_its_products(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A model's forward (and a feature-reading draft's) times each kernel on what it runs: a pass without attention,
    where ours also runs the norms, rotary turn, residual adds and gating inside its calls and the others run them as
    torch operations. Timed on products alone the embedded small model went to BLAS (0.76 against 1.02 ms of
    products), whose decode forward then took 1.41 ms against 0.47 on ours. Each candidate's pass runs its own path
    (ours fused) and computes the same logits to rounding; the record says what was timed, so a choice timed on
    products is not taken for a model timed on passes."""
    from ead_llm.core.fused_draft import FusedDraft
    from ead_llm.core.fused_llama import FusedLlama
    from ead_llm.drafts.model import new_draft

    monkeypatch.setenv("EAD_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_llama, "_TUNED", {})
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    monkeypatch.setattr(Projection, "_agreeing_from", lambda self, counts: 1)  # BLAS taken on any CPU
    monkeypatch.setattr(fused_llama, "_time_rows", _timings_favouring("blas"))  # the products: BLAS twice as fast
    runs: list[tuple[str | None, bool, torch.Tensor]] = []
    real = fused_llama._time_passes

    def passes(run: Any, repeats: int) -> dict[int, float]:
        model = run.__self__  # the forward whose pass is timed
        with torch.inference_mode():
            runs.append((model.head.kernel, model.layers[0].fuses, run(3)))
        seconds = real(run, 1)  # the real timing runs too (its figures are left aside: this test does not time)
        assert sorted(seconds) == list(range(1, TUNED_ROWS + 1)) and all(s > 0 for s in seconds.values())
        return dict.fromkeys(seconds, 1.0 if model.head.kernel == "native" else 2.0)

    monkeypatch.setattr(fused_llama, "_time_passes", passes)
    target = _tiny_llama(0)
    for build in (lambda: FusedLlama(target), lambda: FusedDraft(new_draft(target, torch.arange(40)))):
        forward = build()
        assert all(p.kernel == "native" for p in forward.projections)
        assert [(kernel, fuses) for kernel, fuses, _ in runs] == [("blas", False), ("native", True)]
        (_, _, theirs), (_, _, ours) = runs
        assert ours.shape == (3, 64)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        runs.clear()
    record = json.loads(kernel_record().read_text())
    assert len(record) == 2 and all("|passes|" in key and entry["kernel"] == "native" for key, entry in record.items())
    products = [Projection(p.weight, p.bias, kernel="blas") for p in FusedLlama(_tiny_llama(1)).projections]
    assert choose_kernel(products) == "blas"  # the same shapes timed on products: their own record, not the passes'
