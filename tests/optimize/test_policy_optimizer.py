"""PolicyOptimizer on the embedded pair: a policy per predictor, early stops, reuse of stored answers, composition
with DSPy's optimisers, and the errors bad settings get."""

from __future__ import annotations

import itertools
import math
from typing import Any

import dspy
import pytest
from dspy.utils.dummies import DummyLM

from ead_llm import EAD, CompletionAdapter, EntropyAdaptiveLLM, LargeOnly, PolicyOptimizer, SmallOnly, apply_policies
from ead_llm.optimize.search import cannot_reach, check_score, price, sum_bills
from integrations.dspy_policy_search import EasyAndHard, examples, share_right

CHEAP_EAD = EAD(threshold=0.1, window=1, min_dwell=1, lookahead=True)


@pytest.fixture(autouse=True)
def memory_cache():
    """A fresh in-memory DSPy cache for each test: what a search reuses is what it stored itself."""
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)
    yield
    dspy.configure_cache()


@pytest.fixture(scope="module")
def llm() -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM(max_tokens=300)


@pytest.fixture
def configured(llm: EntropyAdaptiveLLM):
    with dspy.context(lm=llm, adapter=CompletionAdapter(max_demos=0)):
        yield llm


def test_scores_must_be_shares() -> None:
    assert check_score(True) == 1.0 and check_score(0.5) == 0.5 and check_score(0) == 0.0
    for bad in (1.5, -0.1, math.nan, "1", None):
        with pytest.raises(ValueError, match=r"bool or a number in \[0, 1\]"):
            check_score(bad)


def test_a_floor_out_of_reach_is_seen_as_soon_as_it_is() -> None:
    assert not cannot_reach([1, 0], total=4, floor=0.75)  # 1 + 0 + 2 = 3 = 0.75 * 4: still reachable
    assert cannot_reach([1, 0, 0], total=4, floor=0.75)
    assert not cannot_reach([], total=4, floor=1.0)


def test_prices_and_sums_of_bills() -> None:
    bills = [
        {"large_tokens": 3, "completion_tokens": 10, "large_fraction": 0.3},
        {"large_tokens": 1, "completion_tokens": 10},
    ]
    assert price(bills, "large_tokens") == 4
    assert sum_bills(bills)["large_fraction"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="pricing="):
        price(bills, "usd")


class PolicyAware(EasyAndHard):
    """The easy-and-hard program that also says which policies answered (a metric can then be engineered)."""

    def forward(self, easy: str, hard: str) -> dspy.Prediction:
        prediction = super().forward(easy, hard)
        prediction.hard_policy = (self.hard.lm or dspy.settings.lm).policy.name  # no LM set: the configured one
        prediction.hard_instructions = self.hard.signature.instructions
        return prediction


def hard_must_not_be_small(example: dspy.Example, prediction: dspy.Prediction, trace: Any = None) -> bool:
    """1 unless the hard predictor ran SmallOnly: the one configuration this metric forbids."""
    return prediction.hard_policy != "small_only"


def test_each_predictor_gets_the_cheapest_policy_that_holds_the_floor(configured: EntropyAdaptiveLLM) -> None:
    """With a metric that forbids only SmallOnly on the hard predictor: the hard one (the dearer, searched first)
    refuses SmallOnly after one chunk (the floor is out of reach) and takes EAD; the easy one takes SmallOnly; the
    easy predictor's answers are stored from the baseline and reused while the hard one is searched, and priced
    at their bills; the student keeps its LMs."""
    student = PolicyAware()
    trainset = examples("train", 6, seed=11)
    optimiser = PolicyOptimizer(hard_must_not_be_small, candidates=[SmallOnly(), CHEAP_EAD], num_threads=2)
    program = optimiser.compile(student, trainset=trainset)
    report = program.policy_report
    assert report is optimiser.report
    assert program.easy.lm.policy == SmallOnly() and program.hard.lm.policy == CHEAP_EAD
    assert student.easy.lm is None and student.hard.lm is None  # compile works on a copy
    assert [r.name for r in report.predictors] == ["easy", "hard"]
    large_only, hard_small, hard_ead, easy_small = report.trials
    assert large_only.policy["policy"] == "large_only" and large_only.score == 1.0
    assert (hard_small.predictor, hard_small.stopped, hard_small.examples, hard_small.score) == (
        "hard",
        "floor",
        2,
        None,
    )
    assert hard_ead.accepted and easy_small.accepted and easy_small.predictor == "easy"
    assert report.score == 1.0 >= report.floor and report.cost < report.baseline_cost
    assert report.examples_skipped == 4 and report.examples_run == 3 * 6 + 2
    easy, hard = report.predictors
    assert easy.large_tokens == 0 and easy.large_fraction == 0.0 and easy.calls == 6
    assert 0 < hard.large_tokens < hard.large_only_cost and hard.cost_ratio < 1
    # the easy predictor's LargeOnly answers, stored by the baseline, answered the two hard trials' easy calls
    assert report.cache_hits >= 6 + 2
    assert report.search_calls == report.examples_run * 2 - report.cache_hits
    assert report.search_cost["large_tokens"] > 0 and "trials" in report.table()


def test_a_real_metric_keeps_the_floor_on_the_search_set(configured: EntropyAdaptiveLLM) -> None:
    """With the task's own metric, whatever is chosen scores within max_drop of LargeOnly on the examples searched,
    costs no more than LargeOnly, and every trial it accepted held the floor and cost less than the one before."""
    optimiser = PolicyOptimizer(share_right, candidates=[SmallOnly(), CHEAP_EAD], max_drop=0.05, num_threads=4)
    report = optimiser.compile(EasyAndHard(), trainset=examples("train", 8, seed=12)).policy_report
    assert report.score >= report.baseline_score - 0.05 - 1e-9 and report.cost <= report.baseline_cost
    kept = [report.trials[0]] + [t for t in report.trials if t.accepted]
    assert all(t.score is not None and t.score >= report.floor - 1e-9 for t in kept)
    assert all(later.cost < earlier.cost for earlier, later in itertools.pairwise(kept))


def test_it_composes_with_bootstrap_few_shot(configured: EntropyAdaptiveLLM) -> None:
    """After BootstrapFewShot the demos stay and the policies are set; before it, BootstrapFewShot's reset drops
    every predictor's LM, and the report puts the policies back."""
    trainset = examples("train", 4, seed=13)
    metric = hard_must_not_be_small
    bootstrap = dspy.BootstrapFewShot(metric=lambda e, p, t=None: True, max_bootstrapped_demos=1, max_labeled_demos=1)
    demos_first = bootstrap.compile(PolicyAware(), trainset=trainset)
    demos = [len(p.demos) for _, p in demos_first.named_predictors()]
    assert demos == [1, 1]
    optimiser = PolicyOptimizer(metric, candidates=[SmallOnly()], num_threads=2)
    both = optimiser.compile(demos_first, trainset=trainset)
    assert [len(p.demos) for _, p in both.named_predictors()] == demos
    assert both.easy.lm.policy == SmallOnly() and both.hard.lm.policy == LargeOnly()

    policies_first = optimiser.compile(PolicyAware(), trainset=trainset)
    after = bootstrap.compile(policies_first, trainset=trainset)
    assert after.easy.lm is None  # BootstrapFewShot's reset_copy
    policies_first.policy_report.apply(after)
    assert after.easy.lm.policy == SmallOnly() and after.hard.lm.policy == LargeOnly()


class PlainAnswers:
    """Formats DummyLM's scripted answers as the embedded pair's adapter reads them (``#### value``)."""

    def format_field_with_value(self, fields: dict[Any, Any]) -> str:
        return "\n".join(f"#### {value}" for value in fields.values())


def test_it_composes_with_mipro_v2(configured: EntropyAdaptiveLLM) -> None:
    """MIPROv2 (instructions proposed by a scripted prompt model, no demos) before PolicyOptimizer: its instructions
    stay and the policies are set; after it: MIPROv2 copies the program without resetting LMs, so the policies stay."""
    trainset = examples("train", 4, seed=13)
    proposed = "Add and subtract in order."
    prompt_model = DummyLM([{"proposed_instruction": proposed}] * 40, adapter=PlainAnswers())
    mipro = dspy.MIPROv2(
        lambda example, prediction, trace=None: prediction.hard_instructions == proposed,  # engineered to win
        prompt_model=prompt_model,
        auto=None,
        num_candidates=2,
        num_threads=2,
        max_bootstrapped_demos=0,
        max_labeled_demos=0,
    )
    settings: dict[str, Any] = {
        "trainset": trainset,
        "valset": trainset,
        "num_trials": 6,
        "minibatch": False,
        "data_aware_proposer": False,
        "program_aware_proposer": False,
        "tip_aware_proposer": False,
        "fewshot_aware_proposer": False,
    }
    instructed = mipro.compile(PolicyAware(), **settings)
    instructions = [p.signature.instructions for _, p in instructed.named_predictors()]
    assert instructed.hard.signature.instructions == proposed
    optimiser = PolicyOptimizer(hard_must_not_be_small, candidates=[SmallOnly()], num_threads=2)
    both = optimiser.compile(instructed, trainset=trainset)
    assert [p.signature.instructions for _, p in both.named_predictors()] == instructions
    assert both.easy.lm.policy == SmallOnly() and both.hard.lm.policy == LargeOnly()

    after = mipro.compile(optimiser.compile(PolicyAware(), trainset=trainset), **settings)
    assert after.easy.lm.policy == SmallOnly() and after.hard.lm.policy == LargeOnly()


def test_bad_settings_and_programs_are_refused(configured: EntropyAdaptiveLLM) -> None:
    with pytest.raises(ValueError, match="metric must be callable"):
        PolicyOptimizer("accuracy")
    with pytest.raises(ValueError, match="cost must be one of"):
        PolicyOptimizer(share_right, cost="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_drop"):
        PolicyOptimizer(share_right, max_drop=2)
    with pytest.raises(ValueError, match="candidates"):
        PolicyOptimizer(share_right, candidates=[])
    with pytest.raises(ValueError, match="candidates"):
        PolicyOptimizer(share_right, candidates=["fast"])  # type: ignore[list-item]
    optimiser = PolicyOptimizer(share_right, candidates=[SmallOnly()], num_threads=2)
    with pytest.raises(ValueError, match="needs examples"):
        optimiser.compile(EasyAndHard(), trainset=[])
    with (
        pytest.raises(ValueError, match=r"must be an ead_llm\.EntropyAdaptiveLLM"),
        dspy.context(lm=dspy.LM("openai/x")),
    ):
        optimiser.compile(EasyAndHard(), trainset=examples("train", 2))
    with pytest.raises(ValueError, match=r"bool or a number in \[0, 1\]"):
        PolicyOptimizer(lambda e, p, t=None: 5, candidates=[SmallOnly()]).compile(
            EasyAndHard(), trainset=examples("train", 2)
        )
    with pytest.raises(ValueError, match="scored 0 on every example"):
        PolicyOptimizer(lambda e, p, t=None: False, candidates=[SmallOnly()]).compile(
            EasyAndHard(), trainset=examples("train", 2)
        )
    with pytest.raises(ValueError, match="no predictor named"):
        apply_policies(EasyAndHard(), {"medium": SmallOnly()})
