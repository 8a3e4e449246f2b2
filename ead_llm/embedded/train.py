"""Train one model of the embedded pair on the chain-arithmetic task (reproducible: fixed seeds).

    python -m ead_llm.embedded.train --size large --steps 3000 --threads 2 --out ead_llm/embedded/large
    python -m ead_llm.embedded.train --size small --steps 700 --threads 1 --out ead_llm/embedded/small

Writes the model (safetensors), the shared tokenizer and ``training.json`` (settings, time,
curve); ``python -m ead_llm.embedded.finalize`` then evaluates the pair and writes the model
cards. Problems come from the task's train split, generated on the fly; the loss covers the
worked solution only.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedTokenizerFast

from ead_llm.evaluation.task import ALPHABET, Difficulty, Problem, accuracy, problems, random_problem, split_of
from ead_llm.testing.tiny import TinyShape, char_tokenizer, tiny_model

SHAPES = {
    "small": TinyShape(hidden=64, layers=2, heads=4, mlp=256),
    "large": TinyShape(hidden=256, layers=4, heads=8, mlp=768),
}
MAX_POSITIONS = 512


def task_tokenizer() -> PreTrainedTokenizerFast:
    """The pair's tokenizer: ``<pad> <s> </s> <unk>`` then the task's characters; BOS is prepended."""
    return char_tokenizer(ALPHABET)


def train_stream(seed: int, difficulty: Difficulty) -> Any:
    """Endless train-split problems."""
    rng = random.Random(f"ead-llm-train-stream/{seed}")
    while True:
        problem = random_problem(rng, difficulty)
        if split_of(problem.prompt) == "train":
            yield problem


def batch_tensors(
    batch: list[Problem], tokenizer: PreTrainedTokenizerFast
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, labels: [B, T]; labels are -100 on the prompt and padding."""
    rows, masks = [], []
    for problem in batch:
        prompt = tokenizer.encode(problem.prompt, add_special_tokens=True)
        solution = [*tokenizer.encode(problem.solution, add_special_tokens=False), tokenizer.eos_token_id]
        rows.append(prompt + solution)
        masks.append([False] * len(prompt) + [True] * len(solution))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        labels[i, : len(row)] = torch.where(torch.tensor(mask), torch.tensor(row), torch.tensor(-100))
    return ids, attention, labels


@torch.inference_mode()
def greedy_outputs(
    model: GenerationMixin, tokenizer: PreTrainedTokenizerFast, prompts: list[str], batch_size: int = 100
) -> list[str]:
    """Greedy completions with Hugging Face generate, left-padded batches (for training-time checks)."""
    outs: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=True)
        gen = model.generate(**enc, max_new_tokens=MAX_POSITIONS - enc["input_ids"].shape[1] - 1, do_sample=False)
        outs.extend(tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    return outs


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SHAPES), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 3e-3 small, 1.5e-3 large)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-n", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    difficulty = Difficulty()
    tokenizer = task_tokenizer()
    shape = SHAPES[args.size]
    # init_scale 0.02 is Llama's usual initializer range (the tiny test pairs use a larger one)
    model = tiny_model("llama", shape, tokenizer, seed=args.seed, max_positions=MAX_POSITIONS, init_scale=0.02)
    lr = args.lr or (3e-3 if args.size == "small" else 1.5e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    stream = train_stream(args.seed, difficulty)
    dev = problems("dev", args.eval_n, seed=0, difficulty=difficulty)
    curve: list[dict[str, float]] = []
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, lr, args.warmup)
        ids, attention, labels = batch_tensors([next(stream) for _ in range(args.batch)], tokenizer)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            model.eval()
            acc = accuracy(greedy_outputs(model, tokenizer, [p.prompt for p in dev]), [p.answer for p in dev])
            model.train()
            elapsed = time.perf_counter() - start
            curve.append({"step": step + 1, "loss": float(loss), "dev_accuracy": acc, "seconds": elapsed})
            print(json.dumps(curve[-1]), flush=True)
    seconds = time.perf_counter() - start
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    record = {
        "size": args.size,
        "shape": asdict(shape),
        "params": sum(p.numel() for p in model.parameters()),
        "steps": args.steps,
        "batch": args.batch,
        "peak_lr": lr,
        "warmup": args.warmup,
        "seed": args.seed,
        "difficulty": asdict(difficulty),
        "train_seconds": seconds,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "torch": torch.__version__,
        "curve": curve,
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}), flush=True)


if __name__ == "__main__":
    main()
