"""The engine writes exactly what the first engine wrote: every policy's greedy streams (tokens, which
model wrote each, and the passes billed with each) on 100 embedded test problems, recorded before
the engine's second cut by ``python -m tests.data.record_greedy`` (the default suite checks the first 40 of most
policies, CI's slow set all 100)."""

from __future__ import annotations

import json

import pytest

from ead_llm import EntropyAdaptiveLLM
from ead_llm.core.engine import Engine
from tests.data.record_greedy import POLICIES, PROBLEMS, REFERENCE, record


@pytest.fixture(scope="module")
def embedded_engine() -> Engine:
    return EntropyAdaptiveLLM().shared_engine


DEFAULT_PROBLEMS = 40
"""Problems the default suite runs for each policy but EAGER (CI's slow set runs all of them): a request's streams do
not depend on what else its call holds (the engine's batch invariance). EAGER's paths borrow from the call's budget,
so EAGER always runs all of them."""


def _check(engine: Engine, name: str, count: int) -> None:
    expected = json.loads(REFERENCE.read_text())[name]
    expected = {key: value for key, value in expected.items() if int(key.split("/")[0]) < count}
    engine.prefix_caching = False  # the passes as recorded: every prompt computed
    try:
        got = record(engine, POLICIES[name], count)
    finally:
        engine.prefix_caching = True
    assert sorted(got) == sorted(expected)  # the same requests and paths
    assert [key for key in expected if got[key] != expected[key]] == []


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_greedy_streams_equal_the_recorded_ones(embedded_engine: Engine, name: str) -> None:
    _check(embedded_engine, name, PROBLEMS if name.startswith("eager") else DEFAULT_PROBLEMS)


@pytest.mark.slow  # the default suite runs the first DEFAULT_PROBLEMS of most policies
@pytest.mark.parametrize("name", sorted(n for n in POLICIES if not n.startswith("eager")))
def test_greedy_streams_equal_the_recorded_ones_on_every_problem(embedded_engine: Engine, name: str) -> None:
    _check(embedded_engine, name, PROBLEMS)


@pytest.mark.slow  # two runs of 100 problems per policy: CI's slow set
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_prefix_caching_changes_the_passes_never_the_tokens(embedded_engine: Engine, name: str) -> None:
    expected = json.loads(REFERENCE.read_text())[name]
    record(embedded_engine, POLICIES[name])  # every prompt cached (and the answers' full blocks)
    cached = record(embedded_engine, POLICIES[name])

    def text(stream: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in stream.items() if k != "work"}

    assert [key for key in expected if text(cached[key]) != text(expected[key])] == []
    # the embedded task's prompts are short: those with a full block of 16 tokens before their last one reuse it
    assert any(cached[key]["work"] != expected[key]["work"] for key in expected)
