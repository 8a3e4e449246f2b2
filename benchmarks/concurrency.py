"""Continuous batching: many concurrent callers against the same requests one at a time.

For each concurrency level it takes that many test problems of the embedded pair, runs them one
at a time (each call alone on the engine), then all at once from that many threads (each thread
one call; the engine joins them into one running batch), and prints tokens/s of both, the
speed-up, and whether every greedy output is identical.

    python benchmarks/concurrency.py [--levels 16 64] [--policy ead|small|large|speculative] [--max-tokens 400]
        [--hold-ab 4]

``--hold-ab N`` instead times the callers together with the large model's pass held back for fuller batches
(``Scheduler.hold_large`` 1, the default) and without (0), alternated N times in this process: tokens/s of each,
the ratio (median, min-max) and whether every output is the same.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import torch

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.embedded import embedded_pair, recommended_threshold
from ead_llm.evaluation.task import is_correct, problems
from ead_llm.policies.base import LargeOnly, Policy, SmallOnly
from ead_llm.policies.speculative import SpeculativeDecoding
from ead_llm.policies.switching import EAD


def sequential(engine: Engine, requests: list[Request]) -> tuple[list[Completion], float]:
    start = time.perf_counter()
    out = [engine.generate([r])[0] for r in requests]
    return out, time.perf_counter() - start


def concurrent(engine: Engine, requests: list[Request]) -> tuple[list[Completion], float]:
    results: list[Completion | None] = [None] * len(requests)
    barrier = threading.Barrier(len(requests) + 1)

    def call(i: int) -> None:
        barrier.wait()
        results[i] = engine.generate([requests[i]])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return [r for r in results if r is not None], elapsed


def hold_ab(engine: Engine, requests: list[Request], repeats: int) -> dict[str, object]:
    """The callers together with the large pass held back (``hold_large`` 1) and without (0), alternated."""
    rates: dict[int, list[float]] = {0: [], 1: []}
    texts: dict[int, list[tuple[int, ...]]] = {}
    setting = engine.scheduler.hold_large
    for _ in range(repeats):
        for hold in (0, 1):
            engine.scheduler.hold_large = hold
            out, elapsed = concurrent(engine, requests)
            rates[hold].append(sum(len(c.token_ids) for c in out) / elapsed)
            texts.setdefault(hold, [tuple(c.token_ids) for c in out])
    engine.scheduler.hold_large = setting
    ratios = sorted(b / a for a, b in zip(rates[0], rates[1], strict=True))
    return {
        "tokens_per_s_without": statistics.median(rates[0]),
        "tokens_per_s_held": statistics.median(rates[1]),
        "ratio": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]},
        "same_outputs": texts[0] == texts[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--policy", choices=["ead", "small", "large", "speculative"], default="ead")
    parser.add_argument("--hold-ab", type=int, default=0, metavar="N", help="A/B of the held large pass, N times")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    small, large = embedded_pair()
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device="cpu")), max_batch=max(args.levels))
    policy: Policy = {
        "ead": EAD(threshold=recommended_threshold()),
        "small": SmallOnly(),
        "large": LargeOnly(),
        "speculative": SpeculativeDecoding(gamma=4, adaptive_gamma=True),
    }[args.policy]
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; policy {args.policy}"
    )
    rows = []
    for level in args.levels:
        items = problems("test", level)
        requests = [Request(p.prompt, policy, SamplingParams(max_tokens=args.max_tokens)) for p in items]
        if args.hold_ab:
            result = hold_ab(engine, requests, args.hold_ab)
            rows.append({"concurrency": level, **result})
            print(f"{level:3d} callers, held large pass against not: {result}")
            continue
        alone, t_alone = sequential(engine, requests)
        together, t_together = concurrent(engine, requests)
        tokens = sum(len(c.token_ids) for c in alone)
        same = [a.token_ids == b.token_ids for a, b in zip(alone, together, strict=True)]
        row = {
            "concurrency": level,
            "tokens": tokens,
            "sequential_tokens_per_s": tokens / t_alone,
            "concurrent_tokens_per_s": sum(len(c.token_ids) for c in together) / t_together,
            "speedup": t_alone / t_together,
            "identical_outputs": f"{sum(same)}/{len(same)}",
            "accuracy": sum(is_correct(c.text, p.answer) for c, p in zip(together, items, strict=True)) / level,
        }
        rows.append(row)
        print(
            f"{level:3d} callers: one at a time {row['sequential_tokens_per_s']:7.0f} tok/s, together "
            f"{row['concurrent_tokens_per_s']:7.0f} tok/s, speed-up {row['speedup']:.2f}x, identical greedy "
            f"outputs {row['identical_outputs']}"
        )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
