"""A small agent loop on the embedded pair: solve, check the work with a tool, escalate when it fails.

The agent answers with the cheap policy (EAD). A tool checks the worked solution's internal
consistency (column arithmetic, step continuity, answer line; it never solves the problem). When
the check fails, the agent asks again with the large model only (a per-call policy override) and
checks again; after the last attempt it answers with what it has.

    python -m integrations.langchain_agent --problems 40
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from langchain_core.runnables import Runnable, RunnableLambda
from langchain_core.tools import tool

from ead_llm import EntropyAdaptiveLLM, LargeOnly, track_cost
from ead_llm.evaluation.task import consistency_errors, extract_answer, problems


@tool
def check_work(solution: str) -> str:
    """Check a worked arithmetic solution for internal mistakes; returns 'ok' or the first problem found."""
    errors = consistency_errors(solution)
    return "ok" if not errors else errors[0]


def build_agent(llm: EntropyAdaptiveLLM) -> Runnable[str, dict[str, Any]]:
    """problem text -> {"answer", "attempts", "verdicts", "solution"}."""
    attempts = [("ead", llm), ("large_only", llm.bind(policy=LargeOnly()))]

    def solve(problem: str) -> dict[str, Any]:
        verdicts = []
        solution = ""
        for name, model in attempts:
            solution = model.invoke(problem + "\n")
            verdict = check_work.invoke({"solution": solution})
            verdicts.append((name, verdict))
            if verdict == "ok":
                break
        return {
            "answer": extract_answer(solution),
            "attempts": len(verdicts),
            "verdicts": verdicts,
            "solution": solution,
        }

    return RunnableLambda(solve)


@dataclass
class AgentRun:
    problems: int
    first_try_accuracy: float
    accuracy: float
    escalated: int
    large_fraction: float
    parameter_ratio: float
    cost: dict


def run(n: int = 40, split: str = "test") -> AgentRun:
    llm = EntropyAdaptiveLLM(max_tokens=400)
    agent = build_agent(llm)
    items = problems(split, n)  # type: ignore[arg-type]
    with track_cost() as tracker:
        results = agent.batch([p.prompt.strip() for p in items], config={"max_concurrency": 8})
    first = [extract_answer(llm.invoke(p.prompt)) for p in items]
    return AgentRun(
        problems=n,
        first_try_accuracy=sum(a == p.answer for a, p in zip(first, items, strict=True)) / n,
        accuracy=sum(r["answer"] == p.answer for r, p in zip(results, items, strict=True)) / n,
        escalated=sum(r["attempts"] > 1 for r in results),
        large_fraction=tracker.cost["large_fraction"],
        parameter_ratio=tracker.cost["parameter_ratio"],
        cost=tracker.cost,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=40)
    args = parser.parse_args()
    result = run(args.problems)
    print(
        f"{result.problems} test problems: EAD alone {result.first_try_accuracy:.1%}, agent {result.accuracy:.1%} "
        f"({result.escalated} escalated to the large model); large fraction {result.large_fraction:.3f}, "
        f"parameter ratio {result.parameter_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
