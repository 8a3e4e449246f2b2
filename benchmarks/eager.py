"""EAGER against best-of-N with majority vote at the same N, on the embedded pair.

For each decoder (the model that writes the tokens) it runs, on the same problems: one greedy
path; best-of-N (N sampled paths per problem, temperature 0.6, majority vote); and EAGER with
max_paths = N at each theta. Prints accuracy, generated tokens (all paths), paths per problem and
wall-clock. All problems of a method go to the engine in one call (batched).

    python benchmarks/eager.py [--problems 100] [--n 8] [--thetas 0.3 0.6 1.0] [--decoders small ead]
"""

from __future__ import annotations

import argparse
import json
import time

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.embedded import embedded_pair, recommended_threshold
from ead_llm.evaluation.task import is_correct, problems
from ead_llm.policies.base import LargeOnly, Policy, SmallOnly, describe_policy
from ead_llm.policies.eager import EAGER
from ead_llm.policies.switching import EAD

DECODERS = {"small": SmallOnly, "large": LargeOnly, "ead": lambda: EAD(threshold=recommended_threshold())}


def run(engine: Engine, requests: list[Request]) -> tuple[list, float]:
    start = time.perf_counter()
    out = engine.generate(requests)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--split", default="test", choices=["dev", "test"])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--thetas", type=float, nargs="+", default=[0.3, 0.6, 1.0])
    parser.add_argument("--decoders", nargs="+", default=["small", "ead"], choices=sorted(DECODERS))
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    small, large = embedded_pair()
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device="cpu")), max_batch=256)
    items = problems(args.split, args.problems)  # type: ignore[arg-type]
    rows = []
    for name in args.decoders:
        decoder: Policy = DECODERS[name]()
        greedy = SamplingParams(max_tokens=args.max_tokens)
        sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.6, seed=0)
        voter = EAGER(decoder=decoder)
        out, seconds = run(engine, [Request(p.prompt, decoder, greedy) for p in items])
        rows.append(("greedy", decoder, out, seconds, [c.text for c in out], 1.0))
        bon = [Request(p.prompt, decoder, sampled, sample_index=k) for p in items for k in range(args.n)]
        out, seconds = run(engine, bon)
        texts = []
        for i in range(len(items)):
            group = [c.text for c in out[i * args.n : (i + 1) * args.n]]
            texts.append(group[voter.vote(group)[0]])
        rows.append((f"best-of-{args.n}", decoder, out, seconds, texts, float(args.n)))
        for theta in args.thetas:
            policy = EAGER(theta=theta, max_paths=args.n, decoder=decoder)
            out, seconds = run(engine, [Request(p.prompt, policy, sampled) for p in items])
            rows.append((f"eager theta={theta}", decoder, out, seconds, [c.text for c in out], 0.0))
    report = []
    for method, decoder, out, seconds, texts, paths in rows:
        tokens = sum(c.cost.completion_tokens for c in out)
        paths = paths or sum(c.paths for c in out) / len(out)
        accuracy = sum(is_correct(t, p.answer) for t, p in zip(texts, items, strict=True)) / len(items)
        report.append(
            {
                "method": method,
                "decoder": describe_policy(decoder)["policy"],
                "accuracy": accuracy,
                "generated_tokens": tokens,
                "paths_per_problem": paths,
                "wall_time_s": seconds,
            }
        )
        print(
            f"{report[-1]['decoder']:10s} {method:18s} accuracy {accuracy:6.1%}  tokens {tokens:7d}  "
            f"paths/problem {paths:5.2f}  {seconds:6.1f} s"
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
