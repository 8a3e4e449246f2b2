"""The integration suites (real LangChain and DSPy on the embedded pair) at small sizes."""

from __future__ import annotations

import math

import dspy
import pytest

from ead_llm.evaluation.task import consistency_errors
from integrations import dspy_policy_search, dspy_program, langchain_agent, langchain_chain


@pytest.fixture(autouse=True)
def memory_only_dspy_cache():
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)
    yield
    dspy.configure_cache()


def test_lcel_chain_batches_and_streams() -> None:
    result = langchain_chain.run(n=16)
    assert result.calls == math.ceil(16 / 8) + 1  # batches of max_concurrency, then the stream
    assert result.streamed_matches_batch and result.streamed_chunks > 10
    assert 0.0 < result.large_fraction < 1.0
    assert 0.0 <= result.accuracy <= 1.0


def test_agent_escalates_exactly_when_the_check_fails() -> None:
    from ead_llm import EntropyAdaptiveLLM
    from ead_llm.evaluation.task import problems

    result = langchain_agent.run(n=12)
    llm = EntropyAdaptiveLLM(max_tokens=400)
    inconsistent = sum(bool(consistency_errors(llm.invoke(p.prompt))) for p in problems("test", 12))
    assert result.escalated == inconsistent
    assert result.accuracy >= result.first_try_accuracy
    assert result.cost["large_tokens"] > 0


def test_dspy_program_compiles_and_evaluates() -> None:
    result = dspy_program.run(train=4, dev=8, threads=4)
    assert result.demos >= 1  # the large-model teacher bootstrapped traces
    # the adapter renders no demos for the embedded pair, so compiling leaves the prompts unchanged
    assert result.compiled_accuracy == result.baseline_accuracy
    assert result.calls >= 2 * 8
    assert result.cost["completion_tokens"] > 0


@pytest.mark.slow  # 30 s; examples/dspy_policy_optimizer.py runs the same search in the default suite
def test_dspy_policy_search_scores_its_choice_and_the_router_held_out() -> None:
    result = dspy_policy_search.run(search=4, test=4, threads=4)
    report = result.report
    assert [p.name for p in report.predictors] == list(dspy_policy_search.PREDICTORS)
    assert report.score >= report.floor and report.cost <= report.baseline_cost  # what the search guarantees
    names = list(result.test)
    assert names[:2] == ["LargeOnly", "PolicyOptimizer"] and names[2].startswith("QueryRouter(threshold=")
    assert result.test["LargeOnly"].large_tokens > 0 and result.router.threshold in dspy_policy_search.ROUTER_THRESHOLDS
