"""Accuracy against cost of one policy on a list of task problems (the base of the benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ead_llm.engine import Completion, Engine, Request
from ead_llm.ledger import Cost
from ead_llm.policies import Policy, describe_policy
from ead_llm.sampling import SamplingParams
from ead_llm.task import Problem, is_correct


@dataclass(frozen=True)
class PolicyRun:
    """What one policy did on a set of problems."""

    policy: dict[str, object]
    accuracy: float
    correct: tuple[bool, ...]
    cost: Cost
    completions: tuple[Completion, ...]

    @property
    def large_fraction(self) -> float:
        return self.cost.large_fraction

    @property
    def tokens_per_s(self) -> float:
        return self.cost.completion_tokens / self.cost.wall_time_s if self.cost.wall_time_s else 0.0


def run_policy(
    engine: Engine,
    problems: Sequence[Problem],
    policy: Policy,
    *,
    max_tokens: int = 400,
    chunk: int = 50,
) -> PolicyRun:
    """Greedy completions of every problem under ``policy``, scored by exact match."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    completions: list[Completion] = []
    start = time.perf_counter()
    for first in range(0, len(problems), chunk):
        batch = problems[first : first + chunk]
        completions.extend(engine.generate([Request(p.prompt, policy, params) for p in batch]))
    wall = time.perf_counter() - start
    correct = tuple(is_correct(c.text, p.answer) for c, p in zip(completions, problems, strict=True))
    return PolicyRun(
        policy=describe_policy(policy),
        accuracy=sum(correct) / len(correct),
        correct=correct,
        cost=Cost.total([c.cost for c in completions], wall_time_s=wall),
        completions=tuple(completions),
    )
