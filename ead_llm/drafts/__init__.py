"""Drafts made for a target: a small draft over the target's hidden states (:mod:`ead_llm.drafts.model`) and
``ead-llm distill`` that trains it (:mod:`ead_llm.drafts.distill`). Importing this package loads no torch."""

from __future__ import annotations

import argparse
import os

DATA_DTYPES = ("float32", "bfloat16")
"""What the target may write its training answers (and their features) in. ``bfloat16`` writes more of them in the
same time on a CPU with bfloat16 in hardware; the held-out answers that score the draft are written in float32
whatever is chosen. Measured (SmolLM2, 2 threads, 96-token answers to the built-in questions, 600 steps each, scored
on float32 answers to 82 questions neither saw): float32 answers to 600 questions (1,200, 351 s) gave a draft agreeing
on 0.386 / 0.347 / 0.332 of tokens by token of a round; bfloat16 answers to 1,000 (2,000, 437 s) 0.403 / 0.358 /
0.339. Features of the same text in the two precisions had a cosine of 0.9998, and the head's best token on them
agreed at 99.4%."""


HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for transparent huge pages under its CPU tensors of 2 MB or more."""


def prefer_huge_pages() -> None:
    """Have torch back large CPU tensors with transparent huge pages in this process, unless the caller set
    :data:`HUGE_PAGES` already. Training's largest tensors (a batch's head logits: 2,400 rows x 8,192 floats for
    SmolLM2, 78 MB) are larger than glibc's largest mmap threshold, so each is otherwise mapped and zeroed again 4 KB
    at a time at every use. Measured (SmolLM2, 100 steps of 3 passes, 2 threads): 26.8 million page faults and 221 s
    without, 1.7 million and 196 s with, the same loss. Takes effect only before torch's first allocation."""
    os.environ.setdefault(HUGE_PAGES, "1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``ead-llm distill`` (and ``python -m ead_llm.drafts.distill``)."""
    p.add_argument("--large", required=True, help="the target: a Hugging Face id or local folder (Llama family)")
    p.add_argument("--out", required=True, help="folder to write the draft to")
    p.add_argument("--minutes", type=float, default=60.0, help="training time (default 60; the data comes first)")
    p.add_argument(
        "--steps", type=int, default=None, help="train exactly this many steps (default: as many as --minutes allow)"
    )
    p.add_argument("--seed", type=int, default=0, help="questions, split, batches and noise (default 0)")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the draft (default 1, as EAGLE)")
    p.add_argument(
        "--mlp-width",
        type=int,
        default=1,
        help="each draft layer's MLP has this many times the target's units (default 1)",
    )
    p.add_argument("--vocab", type=int, default=8192, help="tokens the draft's head keeps (default 8192)")
    p.add_argument("--samples", type=int, default=4, help="answers per question: 1 greedy, the rest sampled")
    p.add_argument("--questions", type=int, default=None, help="use only the first N questions (default: all)")
    p.add_argument(
        "--own-questions",
        type=int,
        default=0,
        help="also N questions the target writes itself, its chat template opened for a user's turn (default 0)",
    )
    p.add_argument("--own-samples", type=int, default=1, help="answers to each own question (default 1: greedy)")
    p.add_argument("--max-tokens", type=int, default=128, help="longest answer (default 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--batch", type=int, default=16, help="answers per step (default 16)")
    p.add_argument(
        "--depth",
        type=int,
        default=1,
        help="passes of training-time test: the draft also trained on its own guesses (default 1: teacher forced)",
    )
    p.add_argument(
        "--unroll-from",
        type=float,
        default=0.5,
        help="share of training done teacher forced before training-time test begins (default 0.5)",
    )
    p.add_argument(
        "--bfloat16",
        action="store_true",
        help="train under bfloat16 autocast (weights and optimiser stay float32; faster where the CPU has bfloat16 "
        "arithmetic; where it has none, float32 is used and the card says so: torch's emulation is far slower)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--data",
        default=None,
        help="keep the target's answers and features in this file, and reuse it (default: not kept)",
    )
    p.add_argument(
        "--data-dtype",
        choices=DATA_DTYPES,
        default="float32",
        help="write the training answers and their features with the target in this precision: bfloat16 writes "
        "more in the same time on a CPU with bfloat16 in hardware, and float32 is used on one without (held-out "
        "answers stay float32; default float32)",
    )
    p.add_argument(
        "--exclude",
        nargs="+",
        default=None,
        metavar="FILE",
        help="leave out the questions in these files, JSON lines with a prompt or plain lines (default: none)",
    )
