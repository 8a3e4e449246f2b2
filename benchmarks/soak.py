"""Soak: many mixed calls on one shared engine, with resident memory at the start and the end.

Calls come from 8 threads through the LangChain surface (invoke, batch, stream, and streams closed
early), mixing every policy, greedy and seeded sampling, and bad input that must be refused
(invalid options, overlong prompts, lone surrogates, calls that time out). It prints the resident
set size (RSS) after uncounted warm-up calls (allocator pools grow over the first ~100 calls), after
every 100 calls and at the end, the outcome counts, any unexpected
error, and the engine's load at the end (it must be idle with nothing reserved).

    python benchmarks/soak.py [--calls 1000] [--threads 8] [--max-tokens 40] [--warm-up 200]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ead_llm import EAD, EAGER, EASD, EntropyAdaptiveLLM, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.evaluation.task import problems
from ead_llm.policies.controls import RandomSwitching

POLICIES = [
    EAD(threshold=0.05),
    EAD(threshold=0.1, window=1, min_dwell=1, lookahead=True),
    SmallOnly(),
    LargeOnly(),
    SpeculativeDecoding(gamma=4),
    EASD(),
    RandomSwitching(fraction=0.2, block=10),
    EAGER(theta=0.8, max_paths=2, decoder=SmallOnly()),
]


def rss_mib() -> float:
    """Current resident set size of this process in MiB (Linux /proc; else the peak from getrusage)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_call(llm: EntropyAdaptiveLLM, hasty: EntropyAdaptiveLLM, i: int, prompts: list[str]) -> str:
    """Call number ``i`` (its kind and inputs fixed by ``i``); returns the outcome's name."""
    rng = random.Random(i)
    prompt = prompts[i % len(prompts)]
    policy = POLICIES[i % len(POLICIES)]
    options = {"policy": policy, "temperature": rng.choice([0.0, 0.7]), "seed": i}
    kind = rng.choices(["invoke", "batch", "stream", "close", "bad", "long", "surrogate", "timeout"],
                       weights=[40, 15, 15, 8, 8, 5, 4, 5])[0]  # fmt: skip
    if isinstance(policy, EAGER) and kind in ("stream", "close"):
        kind = "invoke"
    try:
        if kind == "invoke":
            llm.invoke(prompt, **options)
        elif kind == "batch":
            llm.batch([prompt, prompts[(i + 1) % len(prompts)]], **options)
        elif kind == "stream":
            "".join(llm.stream(prompt, **options))
        elif kind == "close":
            stream = llm.stream(prompt, **options)
            next(iter(stream))
            stream.close()  # cancels the request and frees its cache
        elif kind == "bad":
            llm.invoke(prompt, **{**options, rng.choice(["temperature", "top_p", "max_tokens"]): -1})
        elif kind == "long":
            llm.invoke("1+1=" * 400, **options)
        elif kind == "surrogate":
            llm.invoke(prompt + "\ud800", **options)
        else:
            hasty.invoke(prompt, **options)
    except ValueError:
        return (
            f"{kind}: refused (ValueError)"
            if kind in ("bad", "long", "surrogate")
            else f"{kind}: UNEXPECTED ValueError"
        )
    except TimeoutError:
        return "timeout: timed out" if kind == "timeout" else f"{kind}: UNEXPECTED TimeoutError"
    except Exception as exc:
        return f"{kind}: UNEXPECTED {type(exc).__name__}: {exc}"
    if kind in ("bad", "long", "surrogate"):
        return f"{kind}: UNEXPECTED success"
    return f"{kind}: ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--warm-up", type=int, default=200, help="uncounted calls before the start RSS")
    args = parser.parse_args()
    before_load = rss_mib()
    llm = EntropyAdaptiveLLM(max_tokens=args.max_tokens)
    hasty = EntropyAdaptiveLLM(max_tokens=args.max_tokens, timeout=0.001)  # the same engine, a 1 ms timeout
    prompts = [p.prompt for p in problems("test", 64)]
    engine = llm.shared_engine
    outcomes: Counter[str] = Counter()
    trace = []
    with ThreadPoolExecutor(max_workers=args.threads) as pool:
        list(pool.map(lambda i: one_call(llm, hasty, i, prompts), range(10**6, 10**6 + args.warm_up)))  # not counted
        gc.collect()
        start_rss = rss_mib()
        start = time.perf_counter()
        for first in range(0, args.calls, 100):
            calls = range(first, min(first + 100, args.calls))
            outcomes.update(pool.map(lambda i: one_call(llm, hasty, i, prompts), calls))
            gc.collect()
            trace.append(f"{calls.stop}: {rss_mib():.1f}")
    seconds = time.perf_counter() - start
    while engine.load["running"]:
        time.sleep(0.01)
    gc.collect()
    end_rss = rss_mib()
    print(f"RSS before loading the pair: {before_load:.1f} MiB")
    print(f"RSS after {args.warm_up} warm-up calls (start): {start_rss:.1f} MiB")
    print(f"RSS (MiB) after each 100 calls: {', '.join(trace)}")
    print(f"RSS after {args.calls} calls (end): {end_rss:.1f} MiB; growth {100 * (end_rss / start_rss - 1):+.2f}%")
    print(f"{args.calls} calls from {args.threads} threads in {seconds:.1f} s")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {count:5d}  {outcome}")
    unexpected = sum(count for outcome, count in outcomes.items() if "UNEXPECTED" in outcome)
    print(f"unexpected outcomes: {unexpected}")
    print(f"engine at the end: {engine.load}, faults {engine.faults}")


if __name__ == "__main__":
    main()
