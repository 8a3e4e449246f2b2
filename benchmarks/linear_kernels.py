"""The engine's projection kernels (oneDNN on packed weights, BLAS on transposed ones, ead-llm's own where it builds)
against torch's default ``F.linear``, on a real model's weights: every projection of every layer and the head, once
per row count, as one forward's matrix products; then each kernel's whole pass without attention (what the engine
times to take the fastest kernel per model and machine, ``choose_kernel``: ours also runs the norms, rotary turn,
residual adds and gating inside its calls, the others run them as torch operations). This prints each.

Why it matters: a speculative verify pass of a few tokens should cost about one decode step; with torch's default
CPU BLAS on some machines it costs nearly once per row. Run with the same threads on both sides:

    OMP_NUM_THREADS=1 python benchmarks/linear_kernels.py [--model smollm2|embedded|embedded-small] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from ead_llm.core.fused_llama import KERNELS, FusedLlama

ROWS = (1, 2, 3, 4, 5, 8, 64, 256)


def timed(fn: Callable[[], None], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "embedded", "embedded-small"), default="smollm2")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.model == "smollm2":
        from ead_llm.testing import smollm2

        folder = str(smollm2.full_model())
    else:
        from ead_llm.embedded import embedded_pair

        folder = str(embedded_pair()[args.model == "embedded"])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fused = FusedLlama(model)
    projections = [p for layer in fused.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    projections.append(fused.head)
    kernels = [k for k in KERNELS if all(p.use(k) for p in projections)]
    if not kernels:
        raise SystemExit("this torch build (or this machine's free memory) prepares no kernel: nothing to compare")
    size = sum(p.weight.numel() * p.weight.element_size() for p in projections) / 2**20
    print(
        f"{folder}: {len(projections)} projections, {size:.0f} MiB of float32 weights, "
        f"{torch.get_num_threads()} thread(s); ms per forward's matrix products, median (min-max) of {args.repeats}"
    )
    print(f"{'rows':>5} {'F.linear':>20}" + "".join(f" {k:>20} {'speed-up':>9}" for k in kernels))
    with torch.inference_mode():
        for rows in ROWS:
            inputs = {p.weight.shape[1]: torch.randn(1, rows, p.weight.shape[1]) for p in projections}

            def plain(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for p in projections:
                    F.linear(inputs[p.weight.shape[1]], p.weight, p.bias)

            def prepared(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for p in projections:
                    p(inputs[p.weight.shape[1]])

            theirs = timed(plain, args.repeats)
            t = statistics.median(theirs)
            line = f"{rows:>5} {f'{t:.2f} ({min(theirs):.2f}-{max(theirs):.2f})':>20}"
            for kernel in kernels:
                for p in projections:
                    p.use(kernel)
                ours = timed(prepared, args.repeats)
                o = statistics.median(ours)
                line += f" {f'{o:.2f} ({min(ours):.2f}-{max(ours):.2f})':>20} {t / o:>8.2f}x"
            print(line)
    print(f"ms per whole pass without attention (FusedLlama.timed_pass), median (min-max) of {args.repeats}")
    print(f"{'rows':>5}" + "".join(f" {k:>20}" for k in kernels))
    with torch.inference_mode():
        for rows in ROWS:
            line = f"{rows:>5}"
            for kernel in kernels:
                for p in projections:
                    p.use(kernel)

                def whole(rows: int = rows) -> None:
                    fused.timed_pass(rows)

                passes = timed(whole, args.repeats)
                line += f" {f'{statistics.median(passes):.2f} ({min(passes):.2f}-{max(passes):.2f})':>20}"
            print(line)


if __name__ == "__main__":
    main()
