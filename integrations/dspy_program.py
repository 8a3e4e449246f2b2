"""A DSPy program on the embedded pair, compiled by an optimiser and evaluated with threads.

The program is a ``ChainOfThought`` solver that checks its own work (the same consistency check
as the LangChain agent) and retries on the large model alone when the check fails.
``BootstrapFewShot`` compiles it with a large-model teacher; ``Evaluate(num_threads=4)`` scores it
before and after. The embedded pair was trained on single problems, so ``CompletionAdapter``
renders no demos for it (``max_demos=0``): prepending one worked demo takes the large model from
97.5% to 0% on 40 dev problems. Compilation therefore leaves this program's prompts unchanged;
``--render-demos`` measures what rendering them would do.

    python -m integrations.dspy_program --train 8 --dev 40
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import dspy

from ead_llm import CompletionAdapter, EntropyAdaptiveLLM, LargeOnly, track_cost
from ead_llm.evaluation.task import consistency_errors, problems


class Solve(dspy.Signature):
    """Work out the chain of additions and subtractions."""

    problem: str = dspy.InputField()
    answer: int = dspy.OutputField()


class CheckedSolver(dspy.Module):
    """Chain of thought; when the worked solution is inconsistent, solve again on the large model."""

    def __init__(self) -> None:
        super().__init__()
        self.solve = dspy.ChainOfThought(Solve)

    def forward(self, problem: str) -> dspy.Prediction:
        prediction = self.solve(problem=problem)
        if consistency_errors(f"{prediction.reasoning}\n#### {prediction.answer}\n"):
            lm = dspy.settings.lm
            with dspy.context(lm=lm.copy(policy=LargeOnly())):
                prediction = self.solve(problem=problem)
        return prediction


def exact_answer(example: dspy.Example, prediction: dspy.Prediction, trace: Any = None) -> bool:
    return example.answer == prediction.answer


def examples(split: str, n: int, seed: int = 0) -> list[dspy.Example]:
    return [
        dspy.Example(problem=p.prompt.strip(), answer=p.answer).with_inputs("problem")
        for p in problems(split, n, seed=seed)  # type: ignore[arg-type]
    ]


@dataclass
class ProgramRun:
    dev: int
    baseline_accuracy: float
    compiled_accuracy: float
    demos: int
    rendered_demos_accuracy: float | None
    calls: int
    cost: dict


def run(train: int = 8, dev: int = 40, *, render_demos: bool = False, threads: int = 4) -> ProgramRun:
    llm = EntropyAdaptiveLLM(max_tokens=400, cache=False)
    trainset, devset = examples("train", train, seed=7), examples("dev", dev)
    evaluate = dspy.Evaluate(  # an unreadable answer is a wrong answer, never a reason to stop
        devset=devset, metric=exact_answer, num_threads=threads, display_progress=False, max_errors=len(devset)
    )
    with dspy.context(lm=llm, adapter=CompletionAdapter(max_demos=0)), track_cost() as tracker:
        baseline = evaluate(CheckedSolver())
        optimiser = dspy.BootstrapFewShot(
            metric=exact_answer,
            max_bootstrapped_demos=2,
            max_labeled_demos=0,
            teacher_settings={"lm": llm.copy(policy=LargeOnly())},
        )
        compiled = optimiser.compile(CheckedSolver(), trainset=trainset)
        after = evaluate(compiled)
    rendered = None
    if render_demos:
        with dspy.context(lm=llm, adapter=CompletionAdapter()):
            rendered = evaluate(compiled).score / 100
    return ProgramRun(
        dev=dev,
        baseline_accuracy=baseline.score / 100,
        compiled_accuracy=after.score / 100,
        demos=len(compiled.solve.predict.demos),
        rendered_demos_accuracy=rendered,
        calls=tracker.calls,
        cost=tracker.cost,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=8)
    parser.add_argument("--dev", type=int, default=40)
    parser.add_argument("--render-demos", action="store_true")
    args = parser.parse_args()
    result = run(args.train, args.dev, render_demos=args.render_demos)
    print(
        f"dev {result.dev}: baseline {result.baseline_accuracy:.1%}, compiled {result.compiled_accuracy:.1%} "
        f"({result.demos} bootstrapped demos); {result.calls} LM calls, large fraction "
        f"{result.cost['large_fraction']:.3f}"
        + ("" if result.rendered_demos_accuracy is None else f"; demos rendered: {result.rendered_demos_accuracy:.1%}")
    )


if __name__ == "__main__":
    main()
