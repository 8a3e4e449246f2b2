"""Does a draft gain from reading several of its target's layers (EAGLE-3's fused features) instead of the last?

A controlled comparison on one ``distill --data`` file: the same answers, split as ``distill`` splits them, the
same draft, steps, schedule and training-time test, only what the draft reads at the position before differs:

* ``final``: the target's final hidden state (after its last norm), as the shipped drafts read it;
* a list such as ``2,15,final`` or ``2,15,27``: the hidden states entering those layers (RMS-normalised, no weight)
  and/or the final one, joined by one more linear map to the width of one (EAGLE-3, arXiv 2503.01840, reads the
  entries of a low, a middle and a high layer). It starts as the ``final`` draft where ``final`` is listed (the
  map passes it through, zeros on the others); otherwise from the highest layer listed.

A variant may end in ``:L`` for a draft of ``L`` decoder layers (default 1), or ``:L:W`` for layers whose MLP is
``W`` times the target's width (default 1; :func:`ead_llm.drafts.model.widened`), to weigh reading more against more
capacity, or ``:L:W:F:B`` to weigh the loss's terms: ``F`` times the smooth-L1 pull toward the target's features
(default 1; EAGLE-3 drops it) and ``B`` times the cross-entropy of the target's best token (default 0), beside the
cross-entropy of its distribution (:func:`ead_llm.drafts.distill.loss_of`).

Each draft is scored as ``distill``'s card scores it: top-1 agreement on held-out answers by token of a round.

    OMP_NUM_THREADS=2 python benchmarks/fused_features.py --data DATA.pt --reads final 2,15,final 2,15,27 final:2

Only the training differs between variants here; the engine runs drafts that read the final state alone.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ead_llm.core.fused_llama import bfloat16_native
from ead_llm.drafts import distill
from ead_llm.drafts.model import FeatureDraft, new_draft, previous
from ead_llm.testing import smollm2

Layers = dict[int, dict[int, torch.Tensor]]  # example id -> layer -> [T, H]


def split(examples: list[distill.Example], seed: int) -> tuple[list[distill.Example], list[distill.Example]]:
    """``distill``'s split of the data file's questions: the set's held-out tenth, then the own questions'."""
    held = distill.held_out_of_both({e.question for e in examples}, random.Random(seed))
    return [e for e in examples if e.question not in held], [e for e in examples if e.question in held]


@torch.no_grad()
def entering(target: Any, examples: list[distill.Example], layers: list[int]) -> Layers:
    """The RMS-normalised hidden states entering each of ``layers`` at every position of each example."""
    out: Layers = {}
    for group in distill.batches(examples, 16):
        ids, mask = distill.padded(group)
        states = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for layer in layers:
            h = states[layer].float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            for row, example in enumerate(group):
                out.setdefault(id(example), {})[layer] = h[row, : len(example.ids)].clone()
    return out


def read(
    draft: FeatureDraft,
    group: list[distill.Example],
    zero_prompt: list[bool],
    noise: float,
    gen: torch.Generator | None,
    *,
    reads: list[str],
    layers: Layers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and what each position reads (``distill.final_states`` for ``final``; joined otherwise)."""
    ids, final = distill.inputs_of(group, zero_prompt, noise, gen)
    if reads == ["final"]:
        return ids, final
    parts = []
    for name in reads:
        if name == "final":
            parts.append(final)
            continue
        width = ids.shape[1]
        x = previous(torch.stack([F.pad(layers[id(e)][int(name)], (0, 0, 0, width - len(e.ids))) for e in group]))
        for row, example in enumerate(group):
            if zero_prompt[row]:
                x[row, : example.start + 1] = 0.0
        if noise:
            x = x + (torch.rand(x.shape, generator=gen) - 0.5) * noise * (x != 0)
        parts.append(x)
    fuse: Any = draft.fuse
    return ids, fuse(torch.cat(parts, dim=-1).to(fuse.weight.dtype))


def trained(
    target: Any,
    index: torch.Tensor,
    train: list[distill.Example],
    args: argparse.Namespace,
    reads: list[str],
    layers: Layers,
    draft_layers: int = 1,
    mlp_width: int = 1,
    objective: tuple[float, float] = (1.0, 0.0),
) -> FeatureDraft:
    """A draft of ``draft_layers`` layers trained as ``distill`` trains it (AdamW, warm-up and cosine decay, zero
    prompt features three times in four, training-time test over ``--depth`` passes from half-way), reading
    ``reads``."""
    torch.manual_seed(args.seed)
    draft = new_draft(target, index, draft_layers, mlp_width).float()
    if reads != ["final"]:
        hidden = draft.config.hidden_size
        draft.fuse = nn.Linear(len(reads) * hidden, hidden, bias=False)
        with torch.no_grad():
            draft.fuse.weight.zero_()
            start = (reads.index("final") if "final" in reads else len(reads) - 1) * hidden
            draft.fuse.weight[:, start : start + hidden] = torch.eye(hidden)
    own = [p for n, p in draft.named_parameters() if n.startswith(("fc", "fuse", "layers", "norm"))]
    for p in draft.parameters():
        p.requires_grad = False
    for p in own:
        p.requires_grad = True
    optimizer = torch.optim.AdamW(own, lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    groups = distill.batches(train, 16)
    bfloat16 = bfloat16_native()  # as distill trains: autocast only where the CPU has bfloat16 arithmetic
    step = 0
    draft.train()
    while step < args.steps:
        rng.shuffle(groups)
        for group in groups:
            if step >= args.steps:
                break
            done = step / args.steps
            for setting in optimizer.param_groups:
                setting["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.05 + 0.475 * (1.0 + math.cos(math.pi * done)))
            zero = [rng.random() < 0.75 for _ in group]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
                reader = partial(read, reads=reads, layers=layers)
                passes = args.depth if done >= 0.5 else 1
                weights = {"feature_weight": objective[0], "top1_weight": objective[1]}
                loss = distill.loss_of(draft, group, zero, 0.2, generator, passes, reader, **weights)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(own, 1.0)
            optimizer.step()
            step += 1
    return draft.eval()


def parse(variant: str) -> tuple[list[str], int, int, tuple[float, float]]:
    """``READS[:LAYERS[:WIDTH[:F:B]]]`` -> (what it reads, its layers, its MLP's width as a multiple of the target's,
    the loss's weights of the feature pull and of the best token's cross-entropy)."""
    parts = variant.split(":")
    layers = int(parts[1]) if len(parts) > 1 else 1
    width = int(parts[2]) if len(parts) > 2 else 1
    weights = (float(parts[3]), float(parts[4])) if len(parts) > 4 else (1.0, 0.0)
    return parts[0].split(","), layers, width, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a `distill --data` file")
    parser.add_argument("--target", default=None, help="the target's folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--reads", nargs="+", default=["final", "2,15,final", "2,15,27"])
    parser.add_argument("--train", type=int, default=1600, help="training answers drawn (default 1600)")
    parser.add_argument("--held", type=int, default=400, help="held-out answers drawn (default 400)")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    examples = torch.load(args.data, weights_only=False)
    train, held = split(examples, args.seed)
    rng = random.Random(args.seed)
    train, held = rng.sample(train, min(args.train, len(train))), rng.sample(held, min(args.held, len(held)))
    target_dir = args.target or str(smollm2.full_model())
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    variants = {v: parse(v) for v in args.reads}
    wanted = sorted({int(n) for names, *_ in variants.values() for n in names if n != "final"})
    started = time.perf_counter()
    layers = entering(target, [*train, *held], wanted) if wanted else {}
    took = time.perf_counter() - started
    print(f"{len(train)} training answers, {len(held)} held out; layers {wanted} read in {took:.0f} s")
    print("training under bfloat16 autocast" if bfloat16_native() else "training in float32 (no bfloat16 in this CPU)")
    vocab = int(target.config.vocab_size)
    eos = target.generation_config.eos_token_id
    index = distill.frequent_tokens(train, 8192, vocab, [eos] if isinstance(eos, int) else list(eos or []))
    figures: dict[str, Any] = {"train": len(train), "held": len(held), "steps": args.steps}
    for reads, (names, draft_layers, mlp_width, objective) in variants.items():
        started = time.perf_counter()
        draft = trained(target, index, train, args, names, layers, draft_layers, mlp_width, objective)
        reader = partial(read, reads=names, layers=layers)
        figures[reads] = [round(a, 4) for a in distill.agreement(draft, held, depth=args.depth, read=reader)]
        print(f"reads {reads}: agreement by token of a round {figures[reads]} ({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
