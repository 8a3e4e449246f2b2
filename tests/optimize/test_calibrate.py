"""calibrate(): the cheapest EAD setting reaching a target against LargeOnly, stored with the pair and used by the
next model built on it; an uncalibrated pair starts on speculative decoding and says how to calibrate."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate

from ead_llm import EAD, EntropyAdaptiveLLM, SpeculativeDecoding
from ead_llm.adapters import pair_model
from ead_llm.embedded import embedded_pair
from ead_llm.evaluation.task import extract_answer, problems
from ead_llm.optimize.calibrate import calibrate, comparable, pair_key, stored_policy, with_policy
from ead_llm.serving.cli import main


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "calibration"
    monkeypatch.setenv("EAD_LLM_CALIBRATION_DIR", str(folder))
    monkeypatch.setattr(pair_model, "_TOLD", set())
    return folder


@pytest.fixture(scope="module")
def folders() -> tuple[str, str]:
    """The embedded pair's folders, passed as a pair of one's own (a real pair whose entropy means something)."""
    small, large = embedded_pair()
    return str(small), str(large)


PROMPTS = [p.prompt for p in problems("dev", 8, seed=21)]


def test_the_cheapest_setting_reaching_the_target_is_chosen_stored_and_used(
    folders: tuple[str, str], calibration_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Agreement with LargeOnly's text: each lookahead setting scans down from its highest threshold and stops at
    the first reaching the target; the cheaper winner is stored, and a model built on the pair without a policy
    starts on it. Before, the pair started on speculative decoding, with one line saying how to calibrate."""
    small, large = folders
    with caplog.at_level(logging.WARNING, logger="ead_llm.adapters.pair_model"):
        before = EntropyAdaptiveLLM(small=small, large=large, max_tokens=160)
        EntropyAdaptiveLLM(small=small, large=large, max_tokens=160)
    assert before.policy == SpeculativeDecoding()
    told = [r.getMessage() for r in caplog.records if "calibrate" in r.getMessage()]
    assert len(told) == 1 and "ead_llm.calibrate(llm, examples)" in told[0]  # once per pair
    result = calibrate(before, PROMPTS, target=0.85, thresholds=(0.8, 0.2, 0.05))
    assert result.reached and result.policy is not None and result.quality is not None and result.quality >= 0.85
    for setting in (True, False):
        runs = [r for r in result.runs if r.policy["lookahead"] is setting]
        reached = [r.quality is not None and r.quality >= 0.85 for r in runs]
        assert reached.count(True) <= 1 and (not any(reached) or reached[-1])  # the scan stops at its first
        assert [r.policy["threshold"] for r in runs] == [0.8, 0.2, 0.05][: len(runs)]
    winners = [r for r in result.runs if r.quality is not None and r.quality >= 0.85]
    assert result.large_tokens == min(r.large_tokens for r in winners) <= result.large_only_tokens
    assert result.search_cost["large_tokens"] >= result.large_only_tokens
    stored = json.loads((calibration_dir / pair_key(small, large)).read_text())
    assert stored["policy"] == result.policy and result.path is not None
    after = EntropyAdaptiveLLM(small=small, large=large, max_tokens=160)
    assert after.policy == result.chosen == stored_policy(small, large)
    assert isinstance(after.policy, EAD)


def test_a_runnable_and_a_metric(folders: tuple[str, str], calibration_dir: Path) -> None:
    """A chain around the model is calibrated by a metric on its output (a share of LargeOnly's score)."""
    small, large = folders
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=160)
    chain = PromptTemplate.from_template("{problem}") | llm | StrOutputParser()
    cases = problems("dev", 6, seed=22)
    answers = {p.prompt: p.answer for p in cases}

    def right(example: dict, output: str) -> bool:
        return extract_answer(output) == answers[example["problem"]]

    result = calibrate(chain, [{"problem": p.prompt} for p in cases], target=0.8, by=right, lookahead=(True,))
    assert result.by == "right" and all(r.policy["lookahead"] for r in result.runs)
    assert result.reached == (result.policy is not None) == (calibration_dir / pair_key(small, large)).exists()
    swapped = with_policy(chain, SpeculativeDecoding())
    assert swapped.steps[1].policy == SpeculativeDecoding() and chain.steps[1].policy == llm.policy


def test_an_unreachable_target_stores_nothing(folders: tuple[str, str], calibration_dir: Path) -> None:
    """Never on the large model (threshold inf), the small model's text rarely equals the large one's: a target
    of 1 is out of reach after the first disagreement, so the run stops early and nothing is stored."""
    small, large = folders
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=160, policy=SpeculativeDecoding())
    result = calibrate(llm, PROMPTS, target=1.0, thresholds=(float("inf"),), lookahead=(True,), max_concurrency=2)
    (run,) = result.runs
    assert not result.reached and result.policy is None and result.path is None
    assert run.quality is None and run.examples < len(PROMPTS)
    assert not calibration_dir.exists() or not any(calibration_dir.iterdir())


def test_bad_arguments_are_refused(folders: tuple[str, str]) -> None:
    small, large = folders
    llm = EntropyAdaptiveLLM(small=small, large=large, policy=SpeculativeDecoding())
    with pytest.raises(ValueError, match="found none in str"):
        calibrate("llm", PROMPTS)
    with pytest.raises(ValueError, match="embedded pair is calibrated already"):
        calibrate(EntropyAdaptiveLLM(), PROMPTS)
    with pytest.raises(ValueError, match="at least one example"):
        calibrate(llm, [])
    with pytest.raises(ValueError, match="target"):
        calibrate(llm, PROMPTS, target=1.5)
    with pytest.raises(ValueError, match="by must be"):
        calibrate(llm, PROMPTS, by="accuracy")
    with pytest.raises(ValueError, match="thresholds"):
        calibrate(llm, PROMPTS, thresholds=(-1.0,))


def test_an_unreadable_store_is_ignored(folders: tuple[str, str], calibration_dir: Path) -> None:
    small, large = folders
    calibration_dir.mkdir(parents=True)
    (calibration_dir / pair_key(small, large)).write_text("{not json")
    assert stored_policy(small, large) is None
    assert EntropyAdaptiveLLM(small=small, large=large).policy == SpeculativeDecoding()


def test_agreement_compares_a_chat_message_by_its_text_and_tool_calls() -> None:
    """Two calls' messages differ in ids and usage even when they say the same; agreement looks past that."""
    call = {"name": "add", "args": {"a": 1}, "id": "call_1"}
    first = AIMessage("7160", id="run-1", usage_metadata={"input_tokens": 3, "output_tokens": 2, "total_tokens": 5})
    same = AIMessage("7160", id="run-2", response_metadata={"cost": {"large_tokens": 2}})
    assert comparable(first) == comparable(same) and comparable("a") == "a"
    assert comparable(AIMessage("", tool_calls=[call])) == comparable(AIMessage("", tool_calls=[{**call, "id": "x"}]))
    assert comparable(AIMessage("", tool_calls=[call])) != comparable(AIMessage("", tool_calls=[{**call, "args": {}}]))
    assert comparable(first) != comparable(AIMessage("7161"))


def test_the_command_line(folders: tuple[str, str], calibration_dir: Path, tmp_path: Path, capsys) -> None:
    """``ead-llm calibrate PROMPTS``: the table, the choice stored for the pair; a file with no prompts, or the
    embedded pair, is refused in one line before anything loads."""
    small, large = folders
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": 0}) + "\n" for p in PROMPTS))
    pair = ["--small", small, "--large", large, "--max-tokens", "160"]
    code = main(["calibrate", str(prompts), *pair, "--target", "0.85", "--thresholds", "0.8", "0.2", "0.05"])
    printed = capsys.readouterr().out
    assert code == (0 if stored_policy(small, large) else 1)
    assert printed.startswith("LargeOnly: ") and "EAD 0.8 bits, lookahead" in printed
    assert ("stored in " in printed) == (code == 0)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["calibrate", str(empty), *pair]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert main(["calibrate", str(prompts)]) == 2
    assert "needs --small and --large" in capsys.readouterr().err
    assert main(["calibrate", str(prompts), *pair, "--target", "2"]) == 2
