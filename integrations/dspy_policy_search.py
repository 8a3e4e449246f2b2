"""PolicyOptimizer on the embedded pair: a program with an easy and a hard predictor gets a policy each.

Each example is two problems: a 3-digit two-step one for ``easy`` and a 4-digit three-step one for ``hard``
(the embedded pair's two ends of difficulty); the metric is the share of the two answered right. The search
runs on train problems; the chosen program, LargeOnly and a query-level router (each call wholly on the small
or the large model by the entropy of its first tokens, at the threshold that matches the optimised program's
accuracy on the search set) are then scored on held-out test problems.

    python -m integrations.dspy_policy_search --search 80 --test 80
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

import dspy

from ead_llm import (
    CompletionAdapter,
    EntropyAdaptiveLLM,
    LargeOnly,
    PolicyOptimizer,
    PolicySearchReport,
    QueryRouter,
    apply_policies,
    track_cost,
)
from ead_llm.core.policy import Policy
from ead_llm.evaluation.task import Difficulty, problems

EASY = Difficulty(min_steps=2, max_steps=2, min_digits=3, max_digits=3)
HARD = Difficulty(min_steps=3, max_steps=3, min_digits=4, max_digits=4)
PREDICTORS = ("easy", "hard")
ROUTER_THRESHOLDS = (0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5)
ROUTER_PROBE = 8


class Solve(dspy.Signature):
    """Work out the chain of additions and subtractions."""

    problem: str = dspy.InputField()
    answer: int = dspy.OutputField()


class EasyAndHard(dspy.Module):
    """Two predictors: one for an easy problem, one for a hard one."""

    def __init__(self) -> None:
        super().__init__()
        self.easy = dspy.Predict(Solve)
        self.hard = dspy.Predict(Solve)

    def forward(self, easy: str, hard: str) -> dspy.Prediction:
        return dspy.Prediction(easy=self.easy(problem=easy).answer, hard=self.hard(problem=hard).answer)


def share_right(example: dspy.Example, prediction: dspy.Prediction, trace: Any = None) -> float:
    """The share of the example's two problems answered right."""
    return ((example.easy_answer == prediction.easy) + (example.hard_answer == prediction.hard)) / 2


def examples(split: str, n: int, seed: int = 0) -> list[dspy.Example]:
    """``n`` examples of one split, each an easy and a hard problem."""
    easy = problems(split, n, seed=seed, difficulty=EASY)  # type: ignore[arg-type]
    hard = problems(split, n, seed=seed, difficulty=HARD)  # type: ignore[arg-type]
    return [
        dspy.Example(
            easy=e.prompt.strip(), hard=h.prompt.strip(), easy_answer=e.answer, hard_answer=h.answer
        ).with_inputs("easy", "hard")
        for e, h in zip(easy, hard, strict=True)
    ]


@dataclass(frozen=True)
class Scored:
    """A program's mean metric and large-model tokens on a set of examples."""

    score: float
    large_tokens: int
    completion_tokens: int


def scored(program: dspy.Module, devset: list[dspy.Example], threads: int) -> Scored:
    """Run ``program`` on ``devset`` (its predictors' LMs should not answer from a cache) and bill it."""
    evaluate = dspy.Evaluate(
        devset=devset, metric=share_right, num_threads=threads, display_progress=False, max_errors=len(devset) + 1
    )
    with track_cost() as tracker:
        result = evaluate(program)
    cost = tracker.cost
    return Scored(result.score / 100, int(cost.get("large_tokens", 0)), int(cost.get("completion_tokens", 0)))


def with_policies(policies: dict[str, Policy], lm: EntropyAdaptiveLLM) -> dspy.Module:
    return apply_policies(EasyAndHard(), policies, lm)


def router_at_quality(
    lm: EntropyAdaptiveLLM, devset: list[dspy.Example], target: float, threads: int
) -> tuple[QueryRouter, Scored]:
    """The cheapest :class:`QueryRouter` threshold whose score on ``devset`` reaches ``target`` (else the
    best-scoring one), with its figures there."""
    runs = []
    for threshold in ROUTER_THRESHOLDS:
        router = QueryRouter(threshold=threshold, probe=ROUTER_PROBE)
        runs.append((router, scored(with_policies(dict.fromkeys(PREDICTORS, router), lm), devset, threads)))
    reaching = [run for run in runs if run[1].score >= target - 1e-9]
    if reaching:
        return min(reaching, key=lambda run: run[1].large_tokens)
    return max(runs, key=lambda run: run[1].score)


@dataclass
class SearchRun:
    report: PolicySearchReport
    test: dict[str, Scored]
    router: QueryRouter


def run(search: int = 80, test: int = 80, *, max_drop: float = 0.02, threads: int = 8) -> SearchRun:
    """Search on ``search`` train examples, then score LargeOnly, the optimised program and the router on
    ``test`` held-out examples. DSPy's cache is kept in memory for this run, so the search's bill is what it
    computes here, not what an earlier run stored on disk."""
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)
    llm = EntropyAdaptiveLLM(max_tokens=400)
    fresh = llm.copy(cache=False)  # held-out scoring: every call computed and billed
    trainset, testset = examples("train", search, seed=3), examples("test", test, seed=4)
    with dspy.context(lm=llm, adapter=CompletionAdapter(max_demos=0)):
        optimiser = PolicyOptimizer(share_right, max_drop=max_drop, num_threads=threads)
        program = optimiser.compile(EasyAndHard(), trainset=trainset)
        report: PolicySearchReport = program.policy_report
        router, _ = router_at_quality(fresh, trainset, report.score, threads)
        figures = {
            "LargeOnly": scored(with_policies(dict.fromkeys(PREDICTORS, LargeOnly()), fresh), testset, threads),
            "PolicyOptimizer": scored(report.apply(EasyAndHard(), fresh), testset, threads),
            f"QueryRouter(threshold={router.threshold})": scored(
                with_policies(dict.fromkeys(PREDICTORS, router), fresh), testset, threads
            ),
        }
    return SearchRun(report, figures, router)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--search", type=int, default=80, help="train examples the search scores on")
    parser.add_argument("--test", type=int, default=80, help="held-out test examples")
    parser.add_argument("--max-drop", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    logging.getLogger("dspy.evaluate.evaluate").setLevel(logging.WARNING)
    logging.getLogger("dspy.utils.parallelizer").setLevel(logging.ERROR)  # SmallOnly's unreadable answers
    result = run(args.search, args.test, max_drop=args.max_drop, threads=args.threads)
    print(result.report.table())
    base = result.test["LargeOnly"]
    print(f"held out ({args.test} examples, {2 * args.test} problems):")
    for name, figures in result.test.items():
        share = figures.large_tokens / base.large_tokens if base.large_tokens else 0.0
        print(
            f"  {name:<32} metric {figures.score:.3f} ({100 * (figures.score - base.score):+.1f} points)  "
            f"large tokens {figures.large_tokens} ({share:.1%} of LargeOnly's)"
        )


if __name__ == "__main__":
    main()
