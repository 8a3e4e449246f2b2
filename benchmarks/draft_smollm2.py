"""The shipped SmolLM2 draft (``ead_llm.testing.smollm2.fast_draft()``) against SmolLM2-135M-Instruct alone.

Chat prompts the draft never trained on (half the questions ``ead-llm distill`` held out, half the
docs/bench-smollm2 questions it was told to leave out), one request at a time, greedy, in one process with
torch on ``--threads`` threads (1 by default). Each repeat times, in a rotating order:

- ``LargeOnly`` (the target alone through our engine) and transformers' ``generate()`` on the same target;
- speculative decoding with adaptive gamma (and fixed gamma 1, 2 and 3, and gamma 3 with rounds ended after an
  unsure draft, ``stop_entropy``), whose texts must equal LargeOnly's;
- EASD with adaptive gamma and at gamma 3 (entropy-aware rejection: not lossless by design; how many texts still
  equal LargeOnly's is printed);
- speculative decoding (adaptive, gamma 3) and EASD with siblings: the draft's second choice at each position read
  in the same verify pass.

Printed: tokens/s of each, each policy's speed-up over LargeOnly (median and min-max over repeats), the
acceptance rate, the large model's passes per token (the share of tokens it wrote, less siblings' extra tokens: a
round's speed-up is at most its inverse), and the draft's cost per token as a ratio of the target's (one decode
forward of each through the engine's runner at 64 and 256 positions, medians). Transformers' assisted generation
cannot run this draft: it hands its assistant token ids only, and the draft reads the target's hidden states
(printed, not measured).

    python benchmarks/draft_smollm2.py [--prompts 16] [--max-tokens 128] [--repeats 3] [--json out.json]
        [--only speculative_gamma3 easd ...] [--exact-verification] [--draft-float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ead_llm import EASD, LargeOnly, SpeculativeDecoding
from ead_llm.adapters.prompts import render
from ead_llm.core.engine import Engine
from ead_llm.core.kv_cache import SequenceKV
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.model_runner import ModelRunner, PassRow
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.policies.base import Policy
from ead_llm.serving.cli import read_prompts
from ead_llm.testing import smollm2

GOALS = {"speculative_adaptive": 1.5, "easd": 1.3}
STOP_ENTROPY = 1.0
"""``speculative_stop``: gamma 3, a round ended after a draft drawn at more than this many bits."""
DRAFT_COST_GOAL = 0.12


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@torch.inference_mode()
def forward_s(
    runner: ModelRunner,
    context: int,
    target: ModelRunner | None = None,
    repeats: int = 21,
    after_prompt: Callable[[], None] | None = None,
) -> float:
    """Median seconds of one decode forward of ``runner``'s model at ``context`` positions (the model alone,
    through the engine's runner). A feature-reading draft reads the target's features there. ``after_prompt`` is
    called once the prompt's pass has run (``benchmarks/step_floor.py`` times the decode passes' products)."""
    tokens = torch.randint(
        4, min(1000, runner.vocab_size), (context + 1,), generator=torch.Generator().manual_seed(context)
    ).tolist()
    kv, target_kv = SequenceKV(), SequenceKV()
    runner.cache.reserve(kv, context + 1)
    if target is not None:
        target.cache.reserve(target_kv, context + 1)
        target.execute([PassRow(target_kv, tokens[:context])])
    row = {"target": target_kv} if target is not None else {}
    runner.execute([PassRow(kv, tokens[:context], **row)])
    if after_prompt is not None:
        after_prompt()
    times = []
    for _ in range(repeats):
        runner.cache.reserve(kv, context + 1)
        start = time.perf_counter()
        out = runner.execute([PassRow(kv, tokens, **row)])
        times.append(time.perf_counter() - start)
        if out.failures:
            raise next(iter(out.failures.values()))
        runner.cache.truncate(kv, context)
    runner.cache.free(kv)
    if target is not None:
        target.cache.free(target_kv)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft", default=None, help="a draft folder (default: the shipped one, assembled)")
    parser.add_argument(
        "--prompts-file",
        default=None,
        help="take the first --prompts questions from this file (JSON lines with a prompt, or one per line) instead "
        "of smollm2.unseen_questions(), e.g. benchmarks/smollm2_own_questions.jsonl",
    )
    parser.add_argument("--draft-cost", type=float, default=None, help="adaptive gamma's draft_cost (default: its own)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument(
        "--exact-verification",
        action="store_true",
        help="verify each draft as the decode step it replaces would compute it (Engine.exact_verification)",
    )
    parser.add_argument(
        "--draft-float32",
        action="store_true",
        help="run the draft's products in float32 (default: bfloat16 where it pays, Engine.draft_bfloat16)",
    )
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="NAME", help="run these rows only (LargeOnly always runs)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    large_dir = str(smollm2.full_model())
    draft_dir = args.draft or str(smollm2.fast_draft())
    engine = Engine(load_pair(LoadConfig(small=draft_dir, large=large_dir, device="cpu")))
    engine.exact_verification = args.exact_verification
    if args.draft_float32:
        engine.draft_bfloat16 = False
    asked = (
        read_prompts(args.prompts_file)[: args.prompts] if args.prompts_file else smollm2.unseen_questions(args.prompts)
    )
    prompts = [render(engine.tokenizer, [("user", q)], "chat") for q in asked]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cost = {} if args.draft_cost is None else {"draft_cost": args.draft_cost}
    policies: dict[str, Policy] = {
        "large_only": LargeOnly(),
        "speculative_adaptive": SpeculativeDecoding(gamma=4, adaptive_gamma=True, **cost),
        "speculative_gamma1": SpeculativeDecoding(gamma=1),
        "speculative_gamma2": SpeculativeDecoding(gamma=2),
        "speculative_gamma3": SpeculativeDecoding(gamma=3),
        "speculative_stop": SpeculativeDecoding(gamma=3, stop_entropy=STOP_ENTROPY),
        "speculative_adaptive_siblings": SpeculativeDecoding(gamma=4, adaptive_gamma=True, siblings=True, **cost),
        "speculative_gamma3_siblings": SpeculativeDecoding(gamma=3, siblings=True),
        "easd": EASD(gamma=4, adaptive_gamma=True, **cost),
        "easd_gamma3": EASD(gamma=3),
        "easd_siblings": EASD(gamma=4, adaptive_gamma=True, siblings=True, **cost),
    }
    known = [*policies, "generate"]
    if args.only is not None:
        unknown = sorted(set(args.only) - set(known))
        if unknown:
            parser.error(f"--only: unknown rows {unknown}; choose from {known}")
        policies = {k: v for k, v in policies.items() if k == "large_only" or k in args.only}

    def run(policy: Policy) -> tuple[float, list[Completion]]:
        start = time.perf_counter()
        out = [engine.generate([Request(p, policy, params)])[0] for p in prompts]
        return time.perf_counter() - start, out

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(large_dir, dtype=torch.float32).eval()
    inputs = [torch.tensor([engine.encode(p)]) for p in prompts]  # the very ids our engine reads

    def generate() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = [
                hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_tokens, do_sample=False)[
                    0, x.shape[1] :
                ].tolist()
                for x in inputs
            ]
        return time.perf_counter() - start, out

    run(LargeOnly())  # warm-up
    names = [*policies, *(["generate"] if args.only is None or "generate" in args.only else [])]
    rates: dict[str, list[float]] = {name: [] for name in names}
    speedups: dict[str, list[float]] = {name: [] for name in names if name != "large_only"}
    outputs: dict[str, list[Completion]] = {}
    generated: list[list[int]] = []
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        seconds: dict[str, float] = {}
        for name in order:
            if name == "generate":
                seconds[name], generated = generate()
                tokens = sum(len(g) for g in generated)
            else:
                seconds[name], outputs[name] = run(policies[name])
                tokens = sum(len(c.token_ids) for c in outputs[name])
            rates[name].append(tokens / seconds[name])
        for name in speedups:
            speedups[name].append(rates[name][-1] / rates["large_only"][-1])
    reference = [list(c.token_ids) for c in outputs["large_only"]]
    same = {
        name: sum(list(c.token_ids) == r for c, r in zip(outs, reference, strict=True))
        for name, outs in outputs.items()
    }
    if "generate" in names:
        same["generate"] = sum(g == r for g, r in zip(generated, reference, strict=True))
    acceptance = {
        name: sum(c.cost.extra.get("accepted_tokens", 0) for c in outs)
        / max(1, sum(c.cost.extra.get("drafted_tokens", 0) for c in outs))
        for name, outs in outputs.items()
        if name != "large_only"
    }
    large_share = {  # a greedy round closes with one large-model token, and a sibling's round with one more
        name: sum(c.cost.large_tokens - c.cost.extra.get("sibling_tokens", 0) for c in outs)
        / max(1, sum(len(c.token_ids) for c in outs))
        for name, outs in outputs.items()
    }
    small, large = engine.runners[Role.SMALL], engine.runners[Role.LARGE]
    cost = {f"draft_cost_{n}": forward_s(small, n, target=large) / forward_s(large, n) for n in (64, 256)}
    draft_bfloat16 = engine.draft_bfloat16
    card_path = Path(draft_dir) / "draft_card.json"
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    engine.close()
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        "prompts": len(prompts),
        "prompts_from": args.prompts_file or "smollm2.unseen_questions",
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "draft_products": "bfloat16" if draft_bfloat16 else "float32",
        "exact_verification": args.exact_verification,
        "tokens_per_s": {k: spread(v) for k, v in rates.items()},
        "speedup_over_large_only": {k: spread(v) for k, v in speedups.items()},
        "same_text_as_large_only": {k: f"{v}/{len(prompts)}" for k, v in same.items()},
        "acceptance": acceptance,
        "large_passes_per_token": large_share,
        **cost,
        "held_out_top1_agreement": card.get("top1_agreement_after"),
        "assisted_generation": "not run: transformers hands its assistant token ids only, and this draft reads "
        "the target's hidden states",
    }
    print(
        f"machine: {report['machine']}; {len(prompts)} chat prompts, greedy, up to {args.max_tokens} tokens; the "
        f"draft's products in {report['draft_products']}"
    )
    print(f"{'':22} {'tokens/s':>9} {'vs LargeOnly (min-max)':>24} {'same text':>10} {'accepted':>9} {'L/token':>8}")
    for name in names:
        r = report["tokens_per_s"][name]["median"]
        s = report["speedup_over_large_only"].get(name)
        ratio = f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})" if s else "1.00x"
        acc = f"{acceptance[name]:.3f}" if name in acceptance else ""
        share = f"{large_share[name]:.3f}" if name in large_share else ""
        print(f"{name:22} {r:9.1f} {ratio:>24} {report['same_text_as_large_only'][name]:>10} {acc:>9} {share:>8}")
    for n in (64, 256):
        print(f"draft cost per token at {n} positions: {cost[f'draft_cost_{n}']:.3f} of the target's")
    print(f"held-out top-1 agreement (card): {report['held_out_top1_agreement']}")
    print(f"assisted generation: {report['assisted_generation']}")
    for name, goal in GOALS.items():
        if name not in speedups:
            continue
        got = report["speedup_over_large_only"][name]["median"]
        print(f"goal: {name} at least {goal}x LargeOnly: {'met' if got >= goal else 'missed'} ({got:.2f}x)")
    worst = max(cost.values())
    verdict = "met" if worst <= DRAFT_COST_GOAL else "missed"
    print(f"goal: draft cost at most {DRAFT_COST_GOAL} of the target's: {verdict} ({worst:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
