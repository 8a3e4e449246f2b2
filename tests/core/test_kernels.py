"""ead-llm's own CPU projection kernel: a row's bits in any call, values to rounding, and every way it can be absent."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from ead_llm.core import fused_llama, kernels
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
    """Outputs past a panel's 16 columns, rows past the 6 a micro-kernel holds and the 64 a block keeps: every row
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
    for start, stop in [(0, 1), (6, 7), (0, 3), (2, 9), (60, 70), (63, 65), (1, 130), (129, 130), (5, 69)]:
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
