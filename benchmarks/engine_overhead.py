"""Engine overhead of EAD: measured time per token against the ideal mix of the two models' times.

For a pair whose large model has >= 10x the small one's parameters (by default a random Llama
pair built here, 25x; or ``--small/--large`` folders or Hub ids), it times SmallOnly and
LargeOnly to get the per-token times t_S and t_L, then EAD at three thresholds, and reports
for EAD the ratio of its measured time per token to ``f_L * t_L + (1 - f_L) * t_S``.
All runs are greedy with a fixed length (EOS ignored), repeated, medians reported.

    python benchmarks/engine_overhead.py [--prompts 8] [--max-tokens 128] [--repeats 5] [--embedded]

With ``--embedded`` it runs the shipped pair (25x) on test problems, where the switching pattern
comes from real entropies; EOS is still ignored so every run has the same length.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.embedded import embedded_pair
from ead_llm.evaluation.task import problems
from ead_llm.policies.base import LargeOnly, Policy, SmallOnly
from ead_llm.policies.switching import EAD
from ead_llm.testing.tiny import TinyShape, build_tiny_pair

SMALL = TinyShape(hidden=64, layers=2, heads=4, mlp=256)
LARGE = TinyShape(hidden=256, layers=4, heads=8, mlp=768)
PROMPT_TEXT = ["12+35=", "7*8=56\n9*", "The quick brown fox", "a+b=", "1000-1=", "Q: 3*4?", "x=1\ny=", "99+1="]


def timed_run(engine: Engine, policy: Policy, prompts: list[str], max_tokens: int) -> dict[str, float]:
    """Decode every prompt in turn (batch 1); return seconds per token and the large fraction."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = large = 0
    start = time.perf_counter()
    for prompt in prompts:
        (done,) = engine.generate([Request(prompt, policy, params)])
        tokens += done.cost.completion_tokens
        large += done.cost.large_tokens
    elapsed = time.perf_counter() - start
    return {"s_per_token": elapsed / tokens, "large_fraction": large / tokens, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", default=None, help="small model folder or id (default: random pair, built here)")
    parser.add_argument("--large", default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--thresholds", type=float, nargs=3, default=None, help="EAD thresholds in bits")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--embedded", action="store_true", help="the embedded pair on its test problems")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = [PROMPT_TEXT[i % len(PROMPT_TEXT)] for i in range(args.prompts)]
    if args.embedded:
        args.small, args.large = embedded_pair()
        prompts = [p.prompt for p in problems("test", args.prompts)]
    elif args.small is None:
        folder = tempfile.mkdtemp(prefix="ead-bench-")
        small_path, large_path = build_tiny_pair(folder, small=SMALL, large=LARGE, seed=0, max_positions=1024)
        args.small, args.large = str(small_path), str(large_path)
    engine = Engine(load_pair(LoadConfig(small=args.small, large=args.large)))
    p_s, p_l = engine.pair.small.info.params, engine.pair.large.info.params
    print(
        f"pair: small {p_s:,} params, large {p_l:,} params ({p_l / p_s:.1f}x); device {engine.pair.device}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )

    # thresholds at quartiles of the small model's own entropies, unless given
    if args.thresholds is None:
        probe = engine.generate(
            [Request(p, SmallOnly(), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)) for p in prompts]
        )
        entropies = sorted(h for c in probe for h in c.entropies)
        q = statistics.quantiles(entropies, n=4)
        args.thresholds = [round(x, 3) for x in q]
    policies: dict[str, Policy] = {"small_only": SmallOnly(), "large_only": LargeOnly()}
    for tau in args.thresholds:
        policies[f"ead tau={tau}"] = EAD(threshold=tau)

    for warm in (SmallOnly(), LargeOnly()):  # warm-up
        timed_run(engine, warm, prompts[:2], 32)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in policies}
    for _ in range(args.repeats):
        for name, policy in policies.items():
            samples[name].append(timed_run(engine, policy, prompts, args.max_tokens))

    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    t_s, t_l = med("small_only", "s_per_token"), med("large_only", "s_per_token")
    rows = []
    print(f"\n{'policy':<22}{'tokens/s':>10}{'f_L':>8}{'ms/token':>10}{'ideal ms':>10}{'measured/ideal':>16}")
    for name in policies:
        t = med(name, "s_per_token")
        f_l = med(name, "large_fraction")
        ideal = f_l * t_l + (1 - f_l) * t_s
        ratio = t / ideal
        rows.append(
            {
                "policy": name,
                "tokens_per_s": 1 / t,
                "large_fraction": f_l,
                "s_per_token": t,
                "ideal_s_per_token": ideal,
                "ratio_to_ideal": ratio,
            }
        )
        print(f"{name:<22}{1 / t:>10.1f}{f_l:>8.3f}{t * 1e3:>10.3f}{ideal * 1e3:>10.3f}{ratio:>16.3f}")
    print("\n" + json.dumps({"t_small_s": t_s, "t_large_s": t_l, "runs": rows}))


if __name__ == "__main__":
    main()
