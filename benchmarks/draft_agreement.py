"""Top-1 agreement of a feature-reading draft with its target, split by how the target wrote the answer.

``ead-llm distill`` reports one agreement over all held-out answers, of which one per question is greedy and the
others sampled at temperature 0.8. Greedy speculative decoding drafts after greedy text only, so this prints
the two apart: the target writes its answers to the questions ``distill`` held out again (the same seeds, so the
same answers), and the draft is scored teacher-forced on each kind (each position reads the target's feature of
the one before, zeros over the prompt, as the card's figure), and, for the second and third token of a round,
on its own guesses of the features before them (as it drafts them; :mod:`ead_llm.drafts.unroll`).

    OMP_NUM_THREADS=1 python benchmarks/draft_agreement.py [--draft DIR ...] [--samples 3] [--max-tokens 96]
        [--prompts-file benchmarks/smollm2_own_questions.jsonl]

``--prompts-file`` scores on those questions instead (e.g. the own questions an earlier run held out, which a later
run with more own questions was told to leave out). Several drafts are scored on the same answers (written once),
so their figures compare.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ead_llm.drafts.distill import REPORTED_STEPS, agreement, held_out_questions, register, written
from ead_llm.serving.cli import read_prompts
from ead_llm.testing import smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--draft", nargs="+", default=None, help="draft folders, each scored (default: the shipped SmolLM2 one)"
    )
    parser.add_argument("--samples", type=int, default=3, help="answers per question, the first greedy")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompts-file",
        default=None,
        help="score on these questions (JSON lines with a prompt, or one per line) instead of those distill held out",
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    register()
    target_dir = str(smollm2.full_model())
    drafts = args.draft or [str(smollm2.fast_draft())]
    if args.prompts_file:
        asked = read_prompts(args.prompts_file)
    else:
        asked = held_out_questions(args.seed, exclude=str(smollm2.BENCH_TASK))
    wanted = [(q, k) for q in range(len(asked)) for k in range(args.samples)]
    examples = written(target_dir, dict(enumerate(asked)), wanted, args.seed, args.max_tokens, None)
    greedy = [e for e in examples if e.sample == 0]
    sampled = [e for e in examples if e.sample]
    figures: dict[str, object] = {
        "questions_from": args.prompts_file or "held out by distill (seed, --exclude docs/bench-smollm2)",
        "questions": len(asked),
        "answers": len(examples),
        "round_tokens": REPORTED_STEPS,
        "greedy_positions": sum(len(e.ids) - 1 - e.start for e in greedy),
    }
    for draft_dir in drafts:
        draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        figures[draft_dir] = {
            "agreement_all": agreement(draft, examples, depth=REPORTED_STEPS),
            "agreement_greedy": agreement(draft, greedy, depth=REPORTED_STEPS),
            "agreement_sampled": agreement(draft, sampled, depth=REPORTED_STEPS) if sampled else None,
        }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
