"""``PolicyOptimizer``: a DSPy teleprompter that gives each predictor of a program its own decoding policy.

Where DSPy's optimisers change what a program says (instructions, demos), this one changes how each of its
predictors decodes: the cheapest policy per predictor that keeps the program's metric within ``max_drop`` of
the score it has with every predictor on the large model alone.

The search is coordinate descent from LargeOnly: the predictors are taken in turn, the dearest first, and
each tries the candidates in order (cheapest first: SmallOnly, then EAD with lookahead from a high threshold
to a low one), keeping the first that holds the floor and costs less than what it replaces; the others keep
their current policy. A trial stops early when it can no longer reach the floor (even scoring 1 on every
example left) or already costs as much as the configuration it would replace. Greedy decoding and DSPy's
cache make unchanged predictors free: their answers are stored from earlier trials (the policy is part of
the cache key), and a stored answer is priced at the bill it had when it was computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dspy
from dspy.teleprompt import Teleprompter

from ead_llm.accounting.tracking import track_cost
from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
from ead_llm.core.policy import check_policy
from ead_llm.core.validation import check_float, check_int
from ead_llm.optimize.search import (
    COST_KEYS,
    CostUnit,
    candidate,
    cannot_reach,
    check_score,
    floor_of,
    policy_text,
    price,
    sum_bills,
)
from ead_llm.policies.base import LargeOnly, Policy, SmallOnly, describe_policy

DEFAULT_THRESHOLDS = (0.4, 0.2, 0.1, 0.05, 0.025)
"""EAD thresholds (bits) of the default candidates, high (cheap) to low (near LargeOnly)."""


def default_candidates(thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> list[Policy]:
    """SmallOnly, then EAD with lookahead (window 1, dwell 1: the large model writes exactly the tokens the small
    one is unsure of) at each of ``thresholds``, given high (cheap) to low: roughly cheapest first."""
    return [SmallOnly()] + [candidate(t, lookahead=True) for t in thresholds]


@dataclass(frozen=True)
class Trial:
    """One configuration evaluated (or stopped early)."""

    predictor: str
    """The predictor whose policy this trial changed ("" for the LargeOnly baseline)."""
    policy: dict[str, Any]
    score: float | None
    """Mean metric over every example; None when stopped early."""
    cost: float
    """The configuration's cost over the examples it ran (stored answers at their bills)."""
    examples: int
    """Examples it ran before it finished or stopped."""
    stopped: str = ""
    """Why it stopped early ("floor": the floor was out of reach; "cost": no cheaper), "" if it ran to the end."""
    accepted: bool = False


@dataclass(frozen=True)
class PredictorReport:
    """What one predictor ended with."""

    name: str
    policy: dict[str, Any]
    calls: int
    large_tokens: int
    completion_tokens: int
    large_fraction: float
    cost: float
    large_only_cost: float
    cost_ratio: float
    """``cost / large_only_cost`` (1.0 when LargeOnly cost nothing)."""


@dataclass
class PolicySearchReport:
    """The search's outcome: scores, per-predictor policies and costs, every trial, and the search's own bill."""

    cost_unit: CostUnit
    examples: int
    baseline_score: float
    floor: float
    score: float
    baseline_cost: float
    cost: float
    predictors: list[PredictorReport] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    search_cost: dict[str, Any] = field(default_factory=dict)
    """What the search itself spent (every call it computed; stored answers are free)."""
    search_calls: int = 0
    cache_hits: int = 0
    examples_run: int = 0
    examples_skipped: int = 0
    """Example runs the early stops saved (of ``len(trials) * examples``)."""
    wall_time_s: float = 0.0
    policies: dict[str, Policy] = field(default_factory=dict)

    @property
    def metric_change(self) -> float:
        """The optimised program's mean metric minus LargeOnly's."""
        return self.score - self.baseline_score

    def apply(self, program: dspy.Module, lm: EntropyAdaptiveLLM | None = None) -> dspy.Module:
        """Give ``program``'s predictors the chosen policies in place (after an optimiser that resets them, such as
        BootstrapFewShot, whose ``reset_copy`` drops every predictor's LM); returns ``program``."""
        apply_policies(program, self.policies, lm)
        return program

    def table(self) -> str:
        """The report as lines of text."""
        unit = self.cost_unit
        lines = [
            f"metric: LargeOnly {self.baseline_score:.3f}, optimised {self.score:.3f} "
            f"({self.metric_change:+.3f}; floor {self.floor:.3f}) on {self.examples} examples",
            f"cost ({unit}): LargeOnly {self.baseline_cost:.4g}, optimised {self.cost:.4g} "
            f"({self.cost / self.baseline_cost if self.baseline_cost else 1.0:.1%})",
        ]
        for p in self.predictors:
            lines.append(
                f"  {p.name}: {policy_text(p.policy)}; {p.calls} calls, large fraction {p.large_fraction:.3f}, "
                f"{unit} {p.cost:.4g} = {p.cost_ratio:.1%} of LargeOnly's"
            )
        lines.append(
            f"search: {len(self.trials)} trials, {self.examples_run} example runs ({self.examples_skipped} saved by "
            f"early stops), {self.search_calls} calls computed, {self.cache_hits} answered from the cache, "
            f"{self.search_cost.get('large_tokens', 0)} large tokens, {self.wall_time_s:.1f} s"
        )
        return "\n".join(lines)


def apply_policies(
    program: dspy.Module, policies: dict[str, Policy], lm: EntropyAdaptiveLLM | None = None
) -> dspy.Module:
    """Set each named predictor's LM to a copy of its own (or ``lm``, or ``dspy.settings.lm``) with its policy."""
    by_name = dict(program.named_predictors())
    unknown = sorted(set(policies) - set(by_name))
    if unknown:
        raise ValueError(f"no predictor named {unknown} in this program; its predictors are {sorted(by_name)}")
    for name, policy in policies.items():
        predictor = by_name[name]
        predictor.lm = _base_lm(predictor, lm).copy(policy=check_policy(policy))
    return program


def _base_lm(predictor: Any, lm: EntropyAdaptiveLLM | None) -> EntropyAdaptiveLLM:
    base = lm or predictor.lm or dspy.settings.lm
    if not isinstance(base, EntropyAdaptiveLLM):
        raise ValueError(
            "PolicyOptimizer chooses ead-llm decoding policies: each predictor's LM (predictor.lm, or "
            f"dspy.configure(lm=...)) must be an ead_llm.EntropyAdaptiveLLM, got {type(base).__name__}"
        )
    return base


class PolicyOptimizer(Teleprompter):
    """Choose a decoding policy per predictor: the least cost whose metric stays within ``max_drop`` of LargeOnly's.

    ``metric(example, prediction, trace=None)`` must return a bool or a number in [0, 1]. ``candidates``: the
    policies tried for every predictor, cheapest first (default :func:`default_candidates`). ``cost``: what is
    minimised, the large model's generated tokens, the USD of the LM's ``pricing=``, or wall time (noisy: the
    machine's load enters it). ``num_threads``: examples run at once (the engine batches them).
    """

    def __init__(
        self,
        metric: Callable[..., Any],
        candidates: Sequence[Policy] | None = None,
        max_drop: float = 0.02,
        cost: CostUnit = "large_tokens",
        num_threads: int | None = None,
    ) -> None:
        super().__init__()
        if not callable(metric):
            raise ValueError(f"metric must be callable as metric(example, prediction, trace=None), got {metric!r}")
        if cost not in COST_KEYS:
            raise ValueError(f"cost must be one of {sorted(COST_KEYS)}, got {cost!r}")
        self.metric = metric
        self.candidates = [
            check_policy(p, "candidates") for p in (default_candidates() if candidates is None else candidates)
        ]
        if not self.candidates:
            raise ValueError("candidates must name at least one policy to try (or None for the default ladder)")
        self.max_drop = check_float("max_drop", max_drop, minimum=0.0, maximum=1.0)
        self.cost = cost
        self.num_threads = check_int("num_threads", num_threads if num_threads is not None else 8, minimum=1)
        self.report: PolicySearchReport | None = None

    def compile(
        self,
        student: dspy.Module,
        trainset: Sequence[dspy.Example] | None = None,
        valset: Sequence[dspy.Example] | None = None,
        *,
        teacher: dspy.Module | None = None,
        **kwargs: Any,
    ) -> dspy.Module:
        """A copy of ``student`` whose predictors carry the chosen policies (``valset``, if given, is what the
        search scores on; else ``trainset``). The report is ``program.policy_report`` and ``self.report``."""
        if teacher is not None or kwargs:
            raise ValueError(
                f"PolicyOptimizer.compile takes student, trainset and valset only; got {sorted(kwargs) or ['teacher']}"
            )
        examples = list(valset if valset else trainset or [])
        if not examples:
            raise ValueError("PolicyOptimizer.compile needs examples: pass trainset= (or valset=) with at least one")
        program = student.deepcopy()
        predictors = dict(program.named_predictors())
        if not predictors:
            raise ValueError(
                "the program has no predictors (dspy.Predict and the modules built on it) to give policies"
            )
        base = {name: _base_lm(p, None) for name, p in predictors.items()}
        started = time.perf_counter()
        with track_cost() as tracker, dspy.context(disable_history=False, max_history_size=10**9):
            search = _Search(self, program, base, examples)
            report = search.run()
        report.search_cost = tracker.cost
        report.search_calls = tracker.calls
        report.wall_time_s = time.perf_counter() - started
        self.report = report
        program.policy_report = report
        return program


class _Search:
    """One compile's state: the current configuration, its cost and score, the trials so far."""

    def __init__(
        self, owner: PolicyOptimizer, program: dspy.Module, base: dict[str, EntropyAdaptiveLLM], examples: list[Any]
    ) -> None:
        self.owner = owner
        self.program = program
        self.base = base
        self.examples = examples
        self.trials: list[Trial] = []
        self.cache_hits = 0
        self._last_bills: dict[str, list[dict[str, Any]]] = {}
        self._last_costs: dict[str, float] = {}

    def run(self) -> PolicySearchReport:
        names = list(self.base)
        current: dict[str, Policy] = dict.fromkeys(names, LargeOnly())
        baseline = self._evaluate(current, "", None, None)
        assert baseline.score is not None
        if baseline.score == 0:
            raise ValueError(
                "with every predictor on LargeOnly the program scored 0 on every example (a failing adapter or "
                "metric?): there is no quality to keep; check the program on one example first"
            )
        floor = floor_of(baseline.score, self.owner.max_drop)
        costs = dict(self._last_costs)
        large_only = dict(costs)
        best = baseline
        bills = dict(self._last_bills)
        for name in sorted(names, key=lambda n: -large_only[n]):  # the dearest first
            for policy in self.owner.candidates:
                trial = self._evaluate({**current, name: policy}, name, floor, best.cost)
                if trial.score is not None and trial.score >= floor - 1e-9 and trial.cost < best.cost:
                    self.trials[-1] = trial = Trial(**{**trial.__dict__, "accepted": True})
                    current[name], best = policy, trial
                    costs, bills = dict(self._last_costs), dict(self._last_bills)
                    break
        assert best.score is not None
        runs = sum(t.examples for t in self.trials)
        return PolicySearchReport(
            cost_unit=self.owner.cost,
            examples=len(self.examples),
            baseline_score=baseline.score,
            floor=floor,
            score=best.score,
            baseline_cost=baseline.cost,
            cost=best.cost,
            predictors=[self._predictor_report(n, current[n], bills[n], costs[n], large_only[n]) for n in names],
            trials=self.trials,
            cache_hits=self.cache_hits,
            examples_run=runs,
            examples_skipped=len(self.trials) * len(self.examples) - runs,
            policies=current,
        )

    def _predictor_report(
        self, name: str, policy: Policy, bills: list[dict[str, Any]], cost: float, large_only: float
    ) -> PredictorReport:
        summed = sum_bills(bills)
        return PredictorReport(
            name=name,
            policy=describe_policy(policy),
            calls=len(bills),
            large_tokens=int(summed.get("large_tokens", 0)),
            completion_tokens=int(summed.get("completion_tokens", 0)),
            large_fraction=summed["large_fraction"],
            cost=cost,
            large_only_cost=large_only,
            cost_ratio=cost / large_only if large_only else 1.0,
        )

    def _evaluate(self, config: dict[str, Policy], changed: str, floor: float | None, ceiling: float | None) -> Trial:
        """Run the program under ``config`` on the examples, in chunks of ``num_threads``, stopping when the
        floor is out of reach or the cost reaches ``ceiling``; records the per-predictor bills and costs."""
        lms = {name: self.base[name].copy(policy=policy) for name, policy in config.items()}
        for name, predictor in self.program.named_predictors():
            predictor.lm = lms[name]
        threads = self.owner.num_threads
        scores: list[float] = []
        stopped = ""
        cost = 0.0
        for start in range(0, len(self.examples), threads):
            chunk = self.examples[start : start + threads]
            evaluate = dspy.Evaluate(
                devset=chunk,
                metric=self.owner.metric,
                num_threads=threads,
                display_progress=False,
                max_errors=len(self.examples) + 1,  # a failing example scores 0; it never ends the search
                provide_traceback=False,
            )
            result = evaluate(self.program)
            scores.extend(check_score(score) for _, _, score in result.results)
            cost = sum(price(self._bills(lm), self.owner.cost) for lm in lms.values())
            if start + threads >= len(self.examples):
                break
            if floor is not None and cannot_reach(scores, len(self.examples), floor):
                stopped = "floor"
                break
            if ceiling is not None and cost >= ceiling:
                stopped = "cost"
                break
        self._last_bills = {name: self._bills(lm) for name, lm in lms.items()}
        self._last_costs = {name: price(bills, self.owner.cost) for name, bills in self._last_bills.items()}
        self.cache_hits += sum(bool(e.get("ead_stored_cost")) for lm in lms.values() for e in lm.history)
        finished = not stopped
        trial = Trial(
            predictor=changed,
            policy=describe_policy(config[changed] if changed else LargeOnly()),
            score=sum(scores) / len(self.examples) if finished else None,
            cost=cost,
            examples=len(scores),
            stopped=stopped,
        )
        self.trials.append(trial)
        return trial

    @staticmethod
    def _bills(lm: EntropyAdaptiveLLM) -> list[dict[str, Any]]:
        """Each call's bill in ``lm``'s history, a stored answer at the bill it had when computed."""
        return [e.get("ead_stored_cost") or e["ead_cost"] for e in lm.history if "ead_cost" in e]
