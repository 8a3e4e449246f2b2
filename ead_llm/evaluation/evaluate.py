"""Accuracy against cost of one policy on a list of problems (the base of the benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ead_llm.accounting.ledger import Cost
from ead_llm.core.engine import Engine
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.evaluation.task import is_correct
from ead_llm.policies.base import Policy, describe_policy


class Item(Protocol):
    """A problem: a prompt and the answer a scorer compares the output with."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> Any: ...


Scorer = Callable[[str, Any], bool]
"""``scorer(output text, expected answer) -> right?``"""


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
    problems: Sequence[Item],
    policy: Policy,
    *,
    max_tokens: int = 400,
    chunk: int = 50,
    sampling: SamplingParams | None = None,
    scorer: Scorer = is_correct,
    on_chunk: Callable[[int], None] | None = None,
) -> PolicyRun:
    """Complete every problem under ``policy`` (greedy with ``max_tokens`` unless ``sampling`` is
    given), ``chunk`` requests per engine call, and score each output with ``scorer``.

    Problem ``i`` draws from random stream ``i`` whatever the chunking, so results do not depend on
    ``chunk``. The wall time is the sum of the engine calls' times; ``on_chunk(n)`` is told after each call.
    """
    if not problems:
        raise ValueError("run_policy needs at least one problem")
    params = sampling or SamplingParams(max_tokens=max_tokens, temperature=0.0)
    completions: list[Completion] = []
    wall = 0.0
    for first in range(0, len(problems), chunk):
        batch = problems[first : first + chunk]
        start = time.perf_counter()
        requests = [Request(p.prompt, policy, params, sample_index=first + i) for i, p in enumerate(batch)]
        completions.extend(engine.generate(requests))
        wall += time.perf_counter() - start
        if on_chunk is not None:
            on_chunk(len(batch))
    correct = tuple(scorer(c.text, p.answer) for c, p in zip(completions, problems, strict=True))
    return PolicyRun(
        policy=describe_policy(policy),
        accuracy=sum(correct) / len(correct),
        correct=correct,
        cost=Cost.total([c.cost for c in completions], wall_time_s=wall),
        completions=tuple(completions),
    )
