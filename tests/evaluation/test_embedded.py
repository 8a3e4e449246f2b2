"""The embedded default pair: shipped in the package, offline, and measurably a pair."""

from __future__ import annotations

import json

import pytest

from ead_llm import EAD, EntropyAdaptiveLLM, LargeOnly, SmallOnly
from ead_llm.embedded import EMBEDDED_DIR, pair_record, recommended_policy, recommended_threshold
from ead_llm.evaluation.evaluate import run_policy
from ead_llm.evaluation.task import problems

MAX_SHIPPED_BYTES = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def llm(monkeypatch_module) -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield mp


def test_loads_offline_with_no_arguments(llm: EntropyAdaptiveLLM) -> None:
    pair = llm.shared_engine.pair
    assert pair.small.info.source.startswith(str(EMBEDDED_DIR))
    assert pair.large.info.non_embedding_params >= 10 * pair.small.info.non_embedding_params
    assert llm.policy == recommended_policy() == EAD(**pair_record()["recommended_policy"])
    text = llm.invoke("12+345-67\n")
    assert "####" in text


def test_shipped_files_fit_and_have_cards() -> None:
    files = [p for p in EMBEDDED_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    weights = [p for p in files if p.suffix == ".safetensors"]
    assert {p.parent.name for p in weights} == {"small", "large"}
    shipped = sum(p.stat().st_size for p in files if p.suffix in {".safetensors", ".json", ".md"})
    assert shipped <= MAX_SHIPPED_BYTES
    for name in ("small", "large"):
        card = (EMBEDDED_DIR / name / "README.md").read_text()
        assert "parameters" in card
        assert "exact match" in card
        training = json.loads((EMBEDDED_DIR / name / "training.json").read_text())
        assert training["train_seconds"] > 0
    record = pair_record()
    assert record["test"]["large_only"]["accuracy"] >= 0.9
    assert record["test"]["small_only"]["accuracy"] <= 0.6


@pytest.mark.slow
def test_accuracy_gap_on_100_test_problems(llm: EntropyAdaptiveLLM) -> None:
    test = problems("test", 100)
    small = run_policy(llm.shared_engine, test, SmallOnly())
    large = run_policy(llm.shared_engine, test, LargeOnly())
    ead = run_policy(llm.shared_engine, test, EAD(threshold=recommended_threshold()))
    assert large.accuracy >= 0.85
    assert small.accuracy <= 0.65
    assert large.accuracy - small.accuracy >= 0.25
    assert small.accuracy < ead.accuracy < large.accuracy  # EAD lands in between
    assert 0.0 < ead.large_fraction <= 0.5
