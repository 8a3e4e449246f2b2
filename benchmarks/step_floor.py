"""Two ideas for a cheaper decode step, measured before building them (one thread, medians of repeats):

1. Attention that reads the paged cache where it lies: per layer, gathering each row's history into a batch
   and one SDPA call (what the engine did for several rows before issue 25), against one SDPA call per row on a
   view of its blocks (what it does now for a row whose blocks are consecutive), with the cache stored
   token-major ``[slots, heads, dim]`` (as it was) and head-major ``[heads, slots, dim]`` (as it is).
   SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64, 30 layers), rows of ``--context``
   positions.
2. A compiled decode step: the embedded pair's large model at batch 1, the fused forward as it is against the
   same layer body compiled with ``torch.compile`` around the paged attention (before and after it).
3. The work between a decode forward's matrix products (norms, rotary, attention, the cache's writes: dozens of
   small operations per layer), in place and alone, with the layers one call per operation (``one_call = False``;
   section 4 weighs the one call): one decode forward through the runner (64 positions, one row) as it runs, its
   products (``Projection.__call__`` and ``Projection.fused``, with the work fused into them) timed where they run;
   the products alone, one after another; and the forward with every product's output replayed from a first call
   (the work between them alone, its code and data staying in the cache). Then one ``F.rms_norm`` of a row alone
   and right after one product, which streams its weight through the cache and evicts what the small operations
   use. The embedded large model, and with ``--smollm2`` SmolLM2-135M-Instruct too.
4. The layers in one kernel call (``kernels.layers``: what the engine runs for a pass whose every query is a decode
   step) against one call per operation (``FusedLlama.one_call = False``): one decode forward through the runner at
   1, 4, 16 and 64 rows of 64 positions, both ways alternated, the fastest sample each; the embedded pair's models,
   and with ``--smollm2`` SmolLM2-135M-Instruct's.

    OMP_NUM_THREADS=1 python -m benchmarks.step_floor [--rows 4] [--context 1100] [--repeats 5] [--smollm2]
        [--only 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from benchmarks.draft_smollm2 import forward_s
from ead_llm import LargeOnly
from ead_llm.core import fused_llama
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.model_runner import ModelRunner
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.embedded import embedded_pair
from ead_llm.evaluation.task import problems

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def median_ms(fn: Callable[[], Any], repeats: int, inner: int) -> list[float]:
    """Milliseconds per call of ``fn`` (``inner`` calls per repeat), one figure per repeat."""
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - start) / inner * 1e3)
    return out


def attention(rows: int, context: int, repeats: int) -> None:
    """One decode step's attention, three ways, each layer's keys and values in their own tensors (a step streams
    them from memory, as the engine's does)."""
    gen = torch.Generator().manual_seed(0)
    stride = context + 128  # each row's blocks lie together, rows apart
    token_major = [  # [slots, H, D], as the cache stored them before
        (torch.randn(rows * stride, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(rows * stride, KV_HEADS, HEAD_DIM))
        for _ in range(LAYERS)
    ]
    head_major = [  # [H, slots, D], as it does now
        (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()) for k, v in token_major
    ]
    query = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=gen)
    spans = [slice(r * stride, r * stride + context) for r in range(rows)]
    slots = torch.cat([torch.arange(span.start, span.stop) for span in spans])

    def gathered() -> list[torch.Tensor]:
        out = []
        for keys, values in token_major:
            k = keys.index_select(0, slots).view(rows, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = values.index_select(0, slots).view(rows, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
            out.append(F.scaled_dot_product_attention(query, k, v, enable_gqa=True))
        return out

    def views(*, head_first: bool) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            out = []
            for keys, values in head_major if head_first else token_major:
                per_row = []
                for r, span in enumerate(spans):
                    if head_first:
                        k, v = keys[:, span][None], values[:, span][None]
                    else:
                        k, v = keys[span].transpose(0, 1)[None], values[span].transpose(0, 1)[None]
                    per_row.append(F.scaled_dot_product_attention(query[r : r + 1], k, v, enable_gqa=True))
                out.append(torch.cat(per_row))
            return out

        return run

    ways = {
        "copied (gather) + one batched SDPA": gathered,
        "one SDPA per row, token-major views": views(head_first=False),
        "one SDPA per row, head-major views": views(head_first=True),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):  # alternating; the outputs are compared last (an earlier comparison was seen to slow
        for name, way in ways.items():  # the next gathers fivefold in this process)
            times[name] += median_ms(way, 1, 3)
    reference = gathered()
    same = all(
        all(torch.allclose(a, b, atol=1e-5) for a, b in zip(reference, way(), strict=True)) for way in ways.values()
    )
    print(f"1. attention of {rows} rows x {context} positions, {LAYERS} layers (one decode step's attention):")
    for name, values in times.items():
        print(f"   {name:<38} median {statistics.median(values):.1f} ms ({min(values):.1f}-{max(values):.1f})")
    print(f"   same outputs: {same}")


def _pre(hidden: Any, norm: Any, eps: float, qkv: Any, bias: Any, cos: Any, sin: Any, shape: tuple[int, ...]) -> Any:
    heads, kv_heads, dim = shape
    tokens = hidden.shape[1]
    x = F.rms_norm(hidden, norm.shape, norm, eps)
    out = F.linear(x, qkv, bias)
    qk = out[..., : (heads + kv_heads) * dim].view(1, tokens, heads + kv_heads, dim).transpose(1, 2)
    qk = fused_llama.rotary(qk, cos, sin)  # sin comes signed, as FusedLlama hands it to its layers
    v = out[..., (heads + kv_heads) * dim :].view(1, tokens, kv_heads, dim).transpose(1, 2)
    return qk[:, :heads], qk[:, heads:], v


def _post(hidden: Any, attended: Any, layer: fused_llama.FusedLayer) -> Any:
    tokens = hidden.shape[1]
    hidden = hidden + F.linear(attended.reshape(1, tokens, -1), layer.o.weight, layer.o.bias)
    x = F.rms_norm(hidden, layer.post_norm[0].shape, layer.post_norm[0], layer.post_norm[1])
    gate, up = F.linear(x, layer.gate_up.weight, layer.gate_up.bias).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, layer.down.weight, layer.down.bias)


def compiled(repeats: int, tokens: int) -> None:
    small, large = embedded_pair()
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device="cpu")))
    request = Request(problems("test", 1)[0].prompt, LargeOnly(), SamplingParams(max_tokens=tokens, ignore_eos=True))
    plain = fused_llama.FusedLayer.__call__
    pre, post = torch.compile(_pre, dynamic=True), torch.compile(_post, dynamic=True)

    def layer_compiled(self: fused_llama.FusedLayer, hidden: Any, cos: Any, sin: Any, batch: Any) -> Any:
        shape = (self.heads, self.kv_heads, self.head_dim)
        q, k, v = pre(hidden, self.input_norm[0], self.input_norm[1], self.qkv.weight, self.qkv.bias, cos, sin, shape)
        batch.write(self.index, k, v)
        return post(hidden, batch.attend(self.attention, q, self.scaling), self)

    def per_token() -> float:
        start = time.perf_counter()
        done = engine.generate([request])[0]
        return (time.perf_counter() - start) / len(done.token_ids) * 1e3

    texts = {}
    results: dict[str, list[float]] = {"as it is": [], "compiled": []}
    for name, body in (("as it is", plain), ("compiled", layer_compiled)):
        fused_llama.FusedLayer.__call__ = body  # type: ignore[method-assign]
        start = time.perf_counter()
        texts[name] = engine.generate([request])[0].text  # warm-up (compiles)
        warm = time.perf_counter() - start
        results[name] = [per_token() for _ in range(repeats)]
        print(f"   {name:<9} warm-up {warm:.1f} s")
    fused_llama.FusedLayer.__call__ = plain  # type: ignore[method-assign]
    print(f"2. the embedded large model at batch 1, {tokens} tokens, ms per token:")
    for name, values in results.items():
        print(f"   {name:<9} median {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
    print(f"   same text: {texts['as it is'] == texts['compiled']}")


def between_products(name: str, runner: ModelRunner, repeats: int) -> None:
    fused = runner._fused
    if fused is None:
        print(f"   {name}: not run on the fused forward; skipped")
        return
    plain = {name: getattr(fused_llama.Projection, name) for name in ("__call__", "fused")}
    spent = [0.0]

    def timed(name: str) -> Callable[..., torch.Tensor]:
        def run(self: fused_llama.Projection, x: torch.Tensor, **work: Any) -> torch.Tensor:
            start = time.perf_counter()
            out = plain[name](self, x, **work)
            spent[0] += time.perf_counter() - start
            return out

        return run

    replayed: dict[tuple[str, int, tuple[int, ...]], torch.Tensor] = {}

    def replay(name: str) -> Callable[..., torch.Tensor]:
        def run(self: fused_llama.Projection, x: torch.Tensor, **work: Any) -> torch.Tensor:
            key = (name, id(self), tuple(x.shape))
            if key not in replayed:
                replayed[key] = plain[name](self, x, **work)
            return replayed[key]

        return run

    def patch(way: Callable[[str], Callable[..., torch.Tensor]] | None) -> None:
        for name, method in plain.items():
            setattr(fused_llama.Projection, name, method if way is None else way(name))

    one_call = getattr(fused, "one_call", None)
    if isinstance(fused, fused_llama.FusedLlama):
        fused.one_call = False  # the calls one at a time: the work between them is what this section weighs
    patch(timed)
    forward = forward_s(runner, 64, repeats=repeats, after_prompt=lambda: spent.__setitem__(0, 0.0)) * 1e3
    products_in_place = spent[0] * 1e3 / repeats
    patch(replay)
    between_alone = forward_s(runner, 64, repeats=repeats) * 1e3
    patch(None)
    if isinstance(fused, fused_llama.FusedLlama):
        fused.one_call = bool(one_call)  # as it was
    inputs = [(p, torch.randn(1, 1, p.weight.shape[1])) for p in fused.projections]

    def products() -> None:
        with torch.inference_mode():
            for projection, x in inputs:
                projection(x)

    alone = statistics.median(median_ms(products, repeats, 1))
    print(
        f"   {name}: forward {forward:.3f} ms; its products alone {alone:.3f} ms; the work between them "
        f"alone {between_alone:.3f} ms, in place about {forward - min(products_in_place, forward):.3f} ms "
        f"(the forward less its products timed where they ran, {products_in_place:.3f} ms)"
    )


def eviction(repeats: int) -> None:
    row, weight = torch.randn(1, 1, 576), torch.randn(576)
    streamed = torch.randn(576, 2 * 1536)  # SmolLM2's gate and up projection, 7 MB

    def norm() -> Any:
        return F.rms_norm(row, (576,), weight, 1e-5)

    def after_product() -> float:
        torch.mm(row[0], streamed)
        start = time.perf_counter()
        norm()
        return (time.perf_counter() - start) * 1e6

    alone = statistics.median(median_ms(norm, repeats, 200)) * 1e3
    after = statistics.median(after_product() for _ in range(200 * repeats))
    print(f"   one F.rms_norm of 576: alone {alone:.1f} us; right after a 576 x 3072 product {after:.1f} us")


def between(repeats: int, *, smollm2_too: bool) -> None:
    print("3. a decode forward (one row, 64 positions): the work between the products, in place and alone")
    small, large = embedded_pair()
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device="cpu")))
    between_products("embedded large model", engine.runners[Role.LARGE], repeats * 20)
    engine.close()
    if smollm2_too:
        from ead_llm.testing import smollm2

        engine = Engine(load_pair(LoadConfig(small=str(smollm2.fast_draft()), large=str(smollm2.full_model()))))
        between_products("SmolLM2-135M-Instruct", engine.runners[Role.LARGE], repeats * 2)
        engine.close()
    eviction(repeats)


def one_call(name: str, runner: ModelRunner, repeats: int, inner: int) -> None:
    from benchmarks.peer import DecodeForward

    fused = runner._fused
    if fused is None or not isinstance(fused, fused_llama.FusedLlama):
        print(f"   {name}: not run on the fused forward; skipped")
        return
    for rows in (1, 4, 16, 64):
        forward = DecodeForward(runner, rows)
        best = {True: float("inf"), False: float("inf")}
        for _ in range(repeats):
            for way in (False, True):
                fused.one_call = way
                forward()  # the first after the other way's
                best[way] = min(best[way], *(forward() for _ in range(inner)))
        fused.one_call = True
        forward.close()
        print(
            f"   {name}, {rows:2} rows: one call per operation {best[False] * 1e3:8.3f} ms, the layers in one call "
            f"{best[True] * 1e3:8.3f} ms ({best[True] / best[False]:.3f})"
        )


def layers_in_one_call(repeats: int, *, smollm2_too: bool) -> None:
    print("4. a decode forward (64 positions), the layers in one kernel call against one call per operation:")
    small, large = embedded_pair()
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device="cpu")))
    for role in (Role.SMALL, Role.LARGE):
        one_call(f"embedded {role.value}", engine.runners[role], repeats, 100)
    engine.close()
    if smollm2_too:
        from ead_llm.testing import smollm2

        engine = Engine(load_pair(LoadConfig(small=str(smollm2.fast_draft()), large=str(smollm2.full_model()))))
        one_call("SmolLM2-135M-Instruct", engine.runners[Role.LARGE], repeats, 10)
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smollm2", action="store_true", help="sections 3 and 4 on SmolLM2-135M-Instruct too")
    parser.add_argument("--only", type=int, choices=(1, 2, 3, 4), default=None, help="run this section only")
    args = parser.parse_args()
    if args.only in (None, 1):
        attention(args.rows, args.context, args.repeats)
    if args.only in (None, 2):
        compiled(args.repeats, args.tokens)
    if args.only in (None, 3):
        between(args.repeats, smollm2_too=args.smollm2)
    if args.only in (None, 4):
        layers_in_one_call(args.repeats, smollm2_too=args.smollm2)


if __name__ == "__main__":
    main()
