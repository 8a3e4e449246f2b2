"""Speculative decoding and EASD against LargeOnly on the embedded pair: speed, acceptance, accuracy.

Each policy decodes the same test problems one request at a time (wall-clock per request, as a
single user sees it), greedy unless ``--temperature``; prints tokens/s, speed-up over LargeOnly,
acceptance rate, EASD's entropy rejections, accuracy, and how many outputs equal LargeOnly's.

    python benchmarks/speculative.py [--problems 100] [--gammas 2 4 8] [--easd-thresholds 2.0 0.5]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from ead_llm.accounting.ledger import Cost
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.embedded import embedded_pair
from ead_llm.evaluation.task import is_correct, problems
from ead_llm.policies.base import LargeOnly, Policy, describe_policy
from ead_llm.policies.speculative import EASD, SpeculativeDecoding


def one_at_a_time(engine: Engine, requests: list[Request]) -> tuple[list[Completion], float]:
    start = time.perf_counter()
    out = [engine.generate([r])[0] for r in requests]
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--easd-thresholds", type=float, nargs="+", default=[2.0, 0.5])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    small, large = embedded_pair()
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device="cpu")))
    items = problems("test", args.problems)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    policies: list[Policy] = [LargeOnly()]
    policies += [SpeculativeDecoding(gamma=g) for g in args.gammas]
    policies += [SpeculativeDecoding(gamma=4, adaptive_gamma=True)]
    policies += [EASD(entropy_threshold=t) for t in args.easd_thresholds]
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.problems} test problems, temperature {args.temperature}, one request at a time"
    )
    engine.generate([Request(items[0].prompt, LargeOnly(), params)])  # warm-up
    rows = []
    reference: list[Completion] = []
    for policy in policies:
        out, seconds = one_at_a_time(engine, [Request(p.prompt, policy, params) for p in items])
        reference = reference or out
        cost = Cost.total([c.cost for c in out], wall_time_s=seconds).to_dict()
        row = {
            **describe_policy(policy),
            "tokens_per_s": cost["completion_tokens"] / seconds,
            "speedup": 0.0,
            "acceptance_rate": cost.get("acceptance_rate"),
            "entropy_rejections": cost.get("entropy_rejections"),
            "accuracy": sum(is_correct(c.text, p.answer) for c, p in zip(out, items, strict=True)) / len(items),
            "same_as_large_only": sum(a.token_ids == b.token_ids for a, b in zip(out, reference, strict=True)),
            "large_processed_tokens": cost["large_processed_tokens"],
            "small_processed_tokens": cost["small_processed_tokens"],
        }
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"] if rows else 1.0
        rows.append(row)
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.3f}"
        print(
            f"{describe_policy(policy)!s:95.95s} {row['tokens_per_s']:7.0f} tok/s  x{row['speedup']:.2f}  "
            f"accept {rate}  rejections {row['entropy_rejections']}  accuracy {row['accuracy']:.1%}  "
            f"same as LargeOnly {row['same_as_large_only']}/{len(items)}"
        )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
