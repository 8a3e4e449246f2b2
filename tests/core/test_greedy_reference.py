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
    got = record(embedded_engine, POLICIES[name])
    assert sorted(got) == sorted(expected)  # the same requests and paths
    assert [key for key in expected if got[key] != expected[key]] == []
