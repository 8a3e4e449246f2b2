"""ead-llm's engine side by side with Hugging Face transformers on the same models, in one run.

Every figure is a ratio measured in this process, ours against theirs (or against our own
baselines), repeated; the median and the spread (min-max) are printed. torch runs one thread on
both sides unless ``--threads`` says otherwise.

(a) the embedded pair, one request at a time, greedy: our ``LargeOnly`` against the large model's
    ``generate()``, and our ``SpeculativeDecoding`` (gamma 4, and adaptive) against assisted
    generation, ``generate(assistant_model=small)``; the greedy texts must agree. Once at the engine
    (``Engine.generate`` against ``generate(ids)``), once as users call each (``EntropyAdaptiveLLM.invoke``
    against ``tokenizer(...)`` then ``generate(**inputs)``). The sides take turns prompt by prompt, so a drift of
    the machine's speed falls on all of them alike.
(b) a random Llama pair with Qwen2.5's 151,936-token vocabulary, 16 requests in one call, sampled
    (temperature 0.8, top-p 0.9): our ``LargeOnly`` against ``generate()`` on the padded batch.
(c) the share of step time spent outside the models' forward passes at batch 64 (embedded pair
    with EAD, and the pair of (b) sampled).
(d) EAD at 16 concurrent callers against the same 16 requests one at a time (embedded pair), and that
    speed-up as a share of what batching 16 rows can give at most on these models in this run,
    ``16 * t(1) / t(16)`` (``t``: a decode forward of each model, through the engine's runner). EAD feeds every
    token to both models (the one not writing catches up later, several tokens in one pass, which alone costs
    about one decode forward), so that speed-up also shows what one caller alone already gains; the last (d)
    figure is the 16 callers' tokens/s against the ceiling the models allow for that work, ``16 / t(16)``. Also
    printed: the share of the headroom counting the models' forward passes alone on both sides (what EAD's passes
    allow, with no work between them).
(e) EAD with lookahead (window 1, dwell 1, 0.05 bits) against the measured-time ideal
    ``f_L * t_L + (1 - f_L) * t_S`` (t_S, t_L: SmallOnly's and LargeOnly's time per token), and how many of the
    generated tokens the large model was fed (it catches up on the small model's, several per pass), and the same
    ratio over the models' forward passes alone. The three policies take turns prompt by prompt, as the sides of (a)
    do.

    python benchmarks/peer.py [--repeats 5] [--problems 20] [--threads 1] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ead_llm import EAD, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.kv_cache import SequenceKV
from ead_llm.core.loading import LoadConfig, LoadedModel, ModelPair, describe_model, load_pair
from ead_llm.core.model_runner import ModelRunner, PassRow
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.embedded import embedded_pair, recommended_threshold
from ead_llm.evaluation.task import problems
from ead_llm.policies.base import Policy
from ead_llm.testing.tiny import big_vocab_tokenizer

QWEN_VOCAB = 151_936
GOALS = {
    "a_large_only": (">=", 1.2),
    "a_speculative": (">=", 1.0),
    "a_speculative_adaptive": (">=", 1.0),
    "b_large_only_sampled": (">=", 2.0),
    "c_outside_forward_embedded": ("<=", 0.15),
    "c_outside_forward_big_vocab": ("<=", 0.15),
    "a_invoke_large_only": (">=", 2.0),
    "a_invoke_speculative": (">=", 1.5),
    "a_invoke_speculative_adaptive": (">=", 1.5),
    "d_ead_16_callers": (">=", 5.0),
    "d_share_of_batching_headroom": (">=", 0.8),
    "d_share_of_batch16_ceiling": (">=", 0.8),
    "e_lookahead_vs_ideal": ("<=", 1.2),
}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    """Seconds and tokens of one run of ``fn`` (which returns the tokens it generated)."""
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def interleaved(sides: Mapping[str, Callable[[str], object]], prompts: list[str]) -> dict[str, float]:
    """Seconds each side takes over ``prompts``, the sides taking turns prompt by prompt, so that a drift of the
    machine's speed during the run (this CPU's wanders by up to 1.5x) falls on every side alike."""
    seconds = dict.fromkeys(sides, 0.0)
    for prompt in prompts:
        for name, side in sides.items():
            start = time.perf_counter()
            side(prompt)
            seconds[name] += time.perf_counter() - start
    return seconds


# -- (a) --------------------------------------------------------------------------------------------


def embedded_peers(prompts: list[str], max_tokens: int, repeats: int) -> dict[str, Any]:
    small_dir, large_dir = embedded_pair()
    engine = Engine(load_pair(LoadConfig(small=small_dir, large=large_dir, device="cpu")))
    hf_large = AutoModelForCausalLM.from_pretrained(large_dir).eval()  # their own copies, untouched by ours
    hf_small = AutoModelForCausalLM.from_pretrained(small_dir).eval()
    tokenizer = engine.tokenizer
    inputs = {p: tokenizer(p, return_tensors="pt").input_ids for p in prompts}

    def ours(policy: Policy) -> Callable[[str], int]:
        def run(prompt: str) -> int:
            return len(engine.generate([Request(prompt, policy, SamplingParams(max_tokens=max_tokens))])[0].token_ids)

        return run

    def theirs(assistant: Any = None) -> Callable[[str], int]:
        def run(prompt: str) -> int:
            ids = inputs[prompt]
            with torch.inference_mode():
                out = hf_large.generate(
                    ids,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    assistant_model=assistant,
                    pad_token_id=tokenizer.pad_token_id,
                )
            return out.shape[1] - ids.shape[1]

        return run

    agree = 0
    with torch.inference_mode():
        for prompt, ids in inputs.items():
            mine = engine.generate([Request(prompt, LargeOnly(), SamplingParams(max_tokens=max_tokens))])[0]
            out = hf_large.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            agree += list(mine.token_ids) == out[0, ids.shape[1] :].tolist()
    sides = {
        "ours_large": ours(LargeOnly()),
        "hf_large": theirs(),
        "ours_spec": ours(SpeculativeDecoding(gamma=4)),
        "ours_adaptive": ours(SpeculativeDecoding(gamma=4, adaptive_gamma=True)),
        "hf_assisted": theirs(hf_small),
    }
    tokens = {name: sum(side(p) for p in prompts) for name, side in sides.items()}
    runs: dict[str, list[float]] = {k: [] for k in ("large_only", "speculative", "speculative_adaptive")}
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        seconds = interleaved(sides, prompts)
        per_s = {name: tokens[name] / seconds[name] for name in sides}
        for key, value in per_s.items():
            rates[key].append(value)
        runs["large_only"].append(per_s["ours_large"] / per_s["hf_large"])
        runs["speculative"].append(per_s["ours_spec"] / per_s["hf_assisted"])
        runs["speculative_adaptive"].append(per_s["ours_adaptive"] / per_s["hf_assisted"])
    return {
        "ratios": {f"a_{k}": spread(v) for k, v in runs.items()},
        "tokens_per_s": {k: spread(v) for k, v in rates.items()},
        "greedy_agreement_with_generate": f"{agree}/{len(prompts)}",
    }


def invoke_peers(prompts: list[str], max_tokens: int, repeats: int) -> dict[str, Any]:
    """(a) as a user runs each side: ``EntropyAdaptiveLLM.invoke`` on the embedded pair against ``tokenizer(...)``
    then ``generate(**inputs)`` (and ``assistant_model=small``) on their own copies. Greedy and lossless, both sides
    write the same text (checked), so a ratio is of times."""
    from transformers import AutoTokenizer

    from ead_llm import EntropyAdaptiveLLM

    small_dir, large_dir = embedded_pair()
    hf_large = AutoModelForCausalLM.from_pretrained(large_dir).eval()
    hf_small = AutoModelForCausalLM.from_pretrained(small_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(large_dir)
    llms = {
        "large_only": EntropyAdaptiveLLM(policy=LargeOnly(), max_tokens=max_tokens),
        "speculative": EntropyAdaptiveLLM(policy=SpeculativeDecoding(gamma=4), max_tokens=max_tokens),
        "speculative_adaptive": EntropyAdaptiveLLM(
            policy=SpeculativeDecoding(gamma=4, adaptive_gamma=True), max_tokens=max_tokens
        ),
    }

    def theirs(prompt: str, assistant: Any = None) -> str:
        with torch.inference_mode():
            inputs = tokenizer(prompt, return_tensors="pt")
            out = hf_large.generate(
                **inputs,
                max_new_tokens=max_tokens,
                do_sample=False,
                assistant_model=assistant,
                pad_token_id=tokenizer.pad_token_id,
            )
        return str(tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True))

    reference = [theirs(p) for p in prompts]
    same = {
        name: sum(llm.invoke(p) == t for p, t in zip(prompts, reference, strict=True)) for name, llm in llms.items()
    }
    sides: dict[str, Callable[[str], object]] = {
        "plain": theirs,
        "assisted": lambda p: theirs(p, hf_small),
        **{name: llm.invoke for name, llm in llms.items()},
    }
    ratios: dict[str, list[float]] = {f"a_invoke_{name}": [] for name in llms}
    for _ in range(repeats):
        seconds = interleaved(sides, prompts)
        for name in llms:
            ratios[f"a_invoke_{name}"].append(seconds["plain" if name == "large_only" else "assisted"] / seconds[name])
    return {
        "ratios": {k: spread(v) for k, v in ratios.items()},
        "same_text_as_generate": {name: f"{count}/{len(prompts)}" for name, count in same.items()},
    }


# -- (b) --------------------------------------------------------------------------------------------


def random_llama(hidden: int, layers: int, seed: int, vocab: int = QWEN_VOCAB) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def big_vocab_pair() -> ModelPair:
    small, large = random_llama(64, 1, 0), random_llama(128, 2, 1)
    return ModelPair(
        tokenizer=big_vocab_tokenizer(QWEN_VOCAB),
        small=LoadedModel(Role.SMALL, small, describe_model("random-llama-64x1", small)),
        large=LoadedModel(Role.LARGE, large, describe_model("random-llama-128x2", large)),
        device=torch.device("cpu"),
        vocab_size=QWEN_VOCAB,
        eos_token_ids=frozenset({1}),
    )


def random_prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 48, (count,), generator=gen).tolist()
    return [torch.randint(3, QWEN_VOCAB, (n,), generator=gen).tolist() for n in lengths]


def big_vocab_peer(max_tokens: int, repeats: int) -> dict[str, Any]:
    engine = Engine(big_vocab_pair())
    hf = random_llama(128, 2, 1)  # the same weights, their own copy
    prompts = random_prompts(16, 0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, ignore_eos=True, seed=1)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded, as generate() wants
    mask = (ids != 0).long()
    for row, prompt in enumerate(prompts):
        mask[row, width - len(prompt) :] = 1

    def ours() -> int:
        return sum(len(c.token_ids) for c in engine.generate([Request(p, LargeOnly(), params) for p in prompts]))

    def theirs() -> int:
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=0.8,
                top_p=0.9,
                top_k=0,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
            )
        return (out.shape[1] - width) * len(prompts)

    ratios, rates = [], {"ours": [], "hf": []}
    for _ in range(repeats):
        mine, hfs = timed(ours), timed(theirs)
        rates["ours"].append(mine[1] / mine[0])
        rates["hf"].append(hfs[1] / hfs[0])
        ratios.append(rates["ours"][-1] / rates["hf"][-1])
    return {
        "ratios": {"b_large_only_sampled": spread(ratios)},
        "tokens_per_s": {k: spread(v) for k, v in rates.items()},
    }


# -- (c) --------------------------------------------------------------------------------------------


class ForwardClock:
    """Adds up the time spent inside the models' forward passes (the runners' model calls)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = 0.0
        for runner in engine.runners.values():
            self._wrap(runner)

    def _wrap(self, runner: ModelRunner) -> None:
        clock = self
        if runner._fused is not None:
            inner = runner._fused

            class Timed:
                def __call__(self, *args: Any, **kwargs: Any) -> Any:
                    start = time.perf_counter()
                    try:
                        return inner(*args, **kwargs)
                    finally:
                        clock.seconds += time.perf_counter() - start

            runner._fused = Timed()  # type: ignore[assignment]
        else:
            model = runner.model
            original = model.forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    clock.seconds += time.perf_counter() - start

            model.forward = forward  # type: ignore[method-assign]


def outside_forward(engine: Engine, requests: list[Request], repeats: int) -> dict[str, float]:
    clock = ForwardClock(engine)
    shares = []
    for _ in range(repeats):
        clock.seconds = 0.0
        elapsed, _ = timed(lambda: sum(len(c.token_ids) for c in engine.generate(requests)))
        shares.append(1.0 - clock.seconds / elapsed)
    return spread(shares)


# -- (d), (e) ---------------------------------------------------------------------------------------


class DecodeForward:
    """One decode forward of ``runner``'s model over ``batch`` rows of 64 positions (the model alone, through the
    engine's runner, no scheduling or sampling), prepared once and timed as often as asked."""

    @torch.inference_mode()  # as the engine's step runs: its cache holds inference tensors
    def __init__(self, runner: ModelRunner, batch: int) -> None:
        self.runner = runner
        gen = torch.Generator().manual_seed(batch)
        tokens = [torch.randint(4, runner.vocab_size, (65,), generator=gen).tolist() for _ in range(batch)]
        self.kvs = [SequenceKV() for _ in range(batch)]
        for kv in self.kvs:
            runner.cache.reserve(kv, 65)
        runner.execute([PassRow(kv, t[:64]) for kv, t in zip(self.kvs, tokens, strict=True)])  # the prompts
        self.rows = list(zip(self.kvs, tokens, strict=True))

    @torch.inference_mode()
    def __call__(self) -> float:
        """Seconds of one forward of the 65th token of every row."""
        for kv in self.kvs:
            self.runner.cache.reserve(kv, 65)
        start = time.perf_counter()
        out = self.runner.execute([PassRow(kv, t) for kv, t in self.rows])
        seconds = time.perf_counter() - start
        if out.failures:
            raise next(iter(out.failures.values()))
        for kv in self.kvs:
            self.runner.cache.truncate(kv, 64)
        return seconds

    def close(self) -> None:
        for kv in self.kvs:
            self.runner.cache.free(kv)


def forward_times(engine: Engine, callers: int, rounds: int = 5, run: int = 3) -> tuple[float, float]:
    """``t(1)`` and ``t(callers)``: one decode forward of each model of the pair, added up, at 1 and ``callers``
    rows: the fastest of ``rounds * run`` samples, since a busy machine only ever adds time (medians of 15 in a row
    ranged over 1.5x between calls on this machine, the fastest over 1.08x). The two sizes are timed in turn,
    ``run`` forwards of one then of the other, so that a stretch of noise lands on both; a run of a few keeps the
    steady state of the repeated passes one caller sees (the first forward after the other size's is slower)."""
    sides = {rows: [DecodeForward(runner, rows) for runner in engine.runners.values()] for rows in (1, callers)}
    samples: dict[int, list[float]] = {rows: [] for rows in sides}
    try:
        for _ in range(rounds):
            for rows, forwards in sides.items():
                samples[rows].extend(sum(forward() for forward in forwards) for _ in range(run))
    finally:
        for forwards in sides.values():
            for forward in forwards:
                forward.close()
    return min(samples[1]), min(samples[callers])


def concurrency(engine: Engine, requests: list[Request], repeats: int) -> dict[str, Any]:
    def alone() -> int:
        return sum(len(engine.generate([r])[0].token_ids) for r in requests)

    def together() -> int:
        counts = [0] * len(requests)
        barrier = threading.Barrier(len(requests))

        def call(i: int) -> None:
            barrier.wait()
            counts[i] = len(engine.generate([requests[i]])[0].token_ids)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts)

    callers = len(requests)
    clock = ForwardClock(engine)
    ratios, shares, ceilings, forward_shares = [], [], [], []
    for _ in range(repeats):
        before = clock.seconds
        a = timed(alone)
        middle = clock.seconds
        b = timed(together)
        forward_alone, forward_together = middle - before, clock.seconds - middle
        ratios.append((b[1] / b[0]) / (a[1] / a[0]))
        t1, t16 = forward_times(engine, callers)
        shares.append(ratios[-1] / (callers * t1 / t16))
        ceilings.append((b[1] / b[0]) / (callers / t16))
        forward_shares.append(((b[1] / forward_together) / (a[1] / forward_alone)) / (callers * t1 / t16))
    return {
        "speed_up": spread(ratios),
        "share_of_headroom": spread(shares),
        "share_of_ceiling": spread(ceilings),
        "forward_share_of_headroom": spread(forward_shares),
    }


def vs_ideal(time_of: Mapping[str, float], tokens: Mapping[str, int], fraction: float) -> float:
    """EAD's time per token against ``fraction * t_L + (1 - fraction) * t_S`` (times per token of each side)."""
    per_token = {name: time_of[name] / tokens[name] for name in ("small", "large", "ead")}
    return per_token["ead"] / (fraction * per_token["large"] + (1 - fraction) * per_token["small"])


def lookahead_round(
    engine: Engine, policies: Mapping[str, Policy], prompts: list[str], params: SamplingParams, clock: ForwardClock
) -> dict[str, float]:
    """One repeat of (e): the sides taking turns prompt by prompt; the ratio end to end and over forward passes."""
    done: dict[str, list[Completion]] = {name: [] for name in policies}
    forward = dict.fromkeys(policies, 0.0)

    def side(name: str, policy: Policy) -> Callable[[str], object]:
        def run(prompt: str) -> None:
            before = clock.seconds
            done[name].append(engine.generate([Request(prompt, policy, params)])[0])
            forward[name] += clock.seconds - before

        return run

    seconds = interleaved({name: side(name, policy) for name, policy in policies.items()}, prompts)
    tokens = {name: sum(c.cost.completion_tokens for c in done[name]) for name in policies}
    fraction = sum(c.cost.large_tokens for c in done["ead"]) / tokens["ead"]
    fed = sum(c.cost.large_processed_tokens - c.cost.prompt_tokens for c in done["ead"]) / tokens["ead"]
    return {
        "ratio": vs_ideal(seconds, tokens, fraction),
        "forward_only": vs_ideal(forward, tokens, fraction),
        "large_fraction": fraction,
        "large_fed_per_token": fed,
    }


def lookahead_vs_ideal(engine: Engine, prompts: list[str], max_tokens: int, repeats: int) -> dict[str, Any]:
    """(e), and the same ratio counting the models' forward passes alone on every side (``forward_only``): what
    EAD's passes (its withheld small-model passes, the large model's catch-ups) cost against the ideal's, with no work
    between passes anywhere. Above the goal, that part is the policy's passes on these models, not the engine."""
    params = SamplingParams(max_tokens=max_tokens)
    lookahead = EAD(threshold=0.05, window=1, min_dwell=1, lookahead=True)
    policies: dict[str, Policy] = {"small": SmallOnly(), "large": LargeOnly(), "ead": lookahead}
    clock = ForwardClock(engine)
    rounds = [lookahead_round(engine, policies, prompts, params, clock) for _ in range(repeats)]
    return {
        "ratio": spread([r["ratio"] for r in rounds]),
        "forward_only": spread([r["forward_only"] for r in rounds]),
        "large_fraction": statistics.median(r["large_fraction"] for r in rounds),
        "large_fed_per_token": statistics.median(r["large_fed_per_token"] for r in rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--problems", type=int, default=20, help="embedded test problems for (a) and (e)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 repeats, 8 problems, shorter runs")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.problems = 2, 8
    torch.set_num_threads(args.threads)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s) on both sides, {args.repeats} repeats"
    )
    prompts = [p.prompt for p in problems("test", args.problems)]
    report: dict[str, Any] = {"ratios": {}}

    a = embedded_peers(prompts, args.max_tokens, args.repeats)
    report["a"] = a
    report["ratios"].update(a["ratios"])
    invoked = invoke_peers(prompts, args.max_tokens, args.repeats)
    report["a_invoke"] = invoked
    report["ratios"].update(invoked["ratios"])
    b = big_vocab_peer(16 if args.quick else 32, args.repeats)
    report["b"] = b
    report["ratios"].update(b["ratios"])

    small_dir, large_dir = embedded_pair()
    embedded = Engine(load_pair(LoadConfig(small=small_dir, large=large_dir, device="cpu")), max_batch=64)
    ead = EAD(threshold=recommended_threshold())
    batch64 = [Request(p.prompt, ead, SamplingParams(max_tokens=args.max_tokens)) for p in problems("test", 64)]
    report["ratios"]["c_outside_forward_embedded"] = outside_forward(embedded, batch64, args.repeats)
    big = Engine(big_vocab_pair(), max_batch=64)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, ignore_eos=True)
    big64 = [Request(p, LargeOnly(), sampled) for p in random_prompts(64, 1)]
    report["ratios"]["c_outside_forward_big_vocab"] = outside_forward(big, big64, max(1, args.repeats // 2))

    callers = [Request(p.prompt, ead, SamplingParams(max_tokens=args.max_tokens)) for p in problems("test", 16)]
    d = concurrency(embedded, callers, args.repeats)
    report["d"] = d
    report["ratios"]["d_ead_16_callers"] = d["speed_up"]
    report["ratios"]["d_share_of_batching_headroom"] = d["share_of_headroom"]
    report["ratios"]["d_share_of_batch16_ceiling"] = d["share_of_ceiling"]
    e = lookahead_vs_ideal(embedded, prompts, args.max_tokens, args.repeats)
    report["e"] = e
    report["ratios"]["e_lookahead_vs_ideal"] = e["ratio"]

    print(f"{'figure':34} {'median':>8} {'min':>8} {'max':>8}  goal      met")
    for name, figure in report["ratios"].items():
        sign, goal = GOALS[name]
        value = figure["median"]
        met = value >= goal if sign == ">=" else value <= goal
        verdict = "yes" if met else "NO"
        print(f"{name:34} {value:8.3f} {figure['min']:8.3f} {figure['max']:8.3f}  {sign} {goal:<5}  {verdict}")
    print(f"(a) tokens/s: { {k: round(v['median']) for k, v in a['tokens_per_s'].items()} }")
    print(f"(a) greedy LargeOnly texts equal to generate()'s: {a['greedy_agreement_with_generate']}")
    print(f"(a) through invoke, texts equal to generate()'s: {invoked['same_text_as_generate']}")
    print(f"(b) tokens/s: { {k: round(v['median']) for k, v in b['tokens_per_s'].items()} }")
    print(
        f"(e) EAD+lookahead large fraction {e['large_fraction']:.3f}; generated tokens the large model was fed, per "
        f"token: {e['large_fed_per_token']:.3f} (the ideal counts only those it wrote; the rest it catches up on)"
    )
    forward_share = d["forward_share_of_headroom"]
    print(
        f"(d) the share of the headroom over the models' forward passes alone: {forward_share['median']:.3f} "
        f"({forward_share['min']:.3f}-{forward_share['max']:.3f}; the passes EAD runs, with no work between them)"
    )
    forward_only = e["forward_only"]
    print(
        f"(e) the same ratio over the models' forward passes alone: {forward_only['median']:.3f} "
        f"({forward_only['min']:.3f}-{forward_only['max']:.3f}; the policy's passes, with no work between them)"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
