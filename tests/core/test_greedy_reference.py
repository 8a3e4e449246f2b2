"""The engine writes exactly what the first engine wrote: every policy's greedy streams (tokens, which
model wrote each, and the passes billed with each) on 100 embedded test problems, recorded before
the engine's second cut by ``python -m tests.data.record_greedy``."""

from __future__ import annotations

import json

import pytest

from ead_llm import EntropyAdaptiveLLM
from ead_llm.core.engine import Engine
from tests.data.record_greedy import POLICIES, REFERENCE, record


@pytest.fixture(scope="module")
def embedded_engine() -> Engine:
    return EntropyAdaptiveLLM().shared_engine


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_greedy_streams_equal_the_recorded_ones(embedded_engine: Engine, name: str) -> None:
    expected = json.loads(REFERENCE.read_text())[name]
    embedded_engine.prefix_caching = False  # the passes as recorded: every prompt computed
    try:
        got = record(embedded_engine, POLICIES[name])
    finally:
        embedded_engine.prefix_caching = True
    assert sorted(got) == sorted(expected)  # the same requests and paths
    assert [key for key in expected if got[key] != expected[key]] == []


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
