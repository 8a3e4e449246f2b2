"""CompletionAdapter: signatures onto a plain prompt/answer format, and back."""

from __future__ import annotations

import dspy
import pytest
from dspy.utils.exceptions import AdapterParseError

from ead_llm import CompletionAdapter


class Solve(dspy.Signature):
    problem: str = dspy.InputField()
    answer: int = dspy.OutputField()


class Explain(dspy.Signature):
    topic: str = dspy.InputField()
    level: str = dspy.InputField()
    notes: str = dspy.OutputField()
    summary: str = dspy.OutputField()


def test_prompt_is_the_input_lines_with_demos_first() -> None:
    demos = [{"problem": "1+2+3", "answer": 6}, {"problem": "only input"}]
    messages = CompletionAdapter().format(Solve, demos, {"problem": "4821+3907-1568"})
    assert messages == [{"role": "user", "content": "1+2+3\n#### 6\n4821+3907-1568\n"}]
    assert CompletionAdapter(max_demos=0).format(Solve, demos, {"problem": "7+8"})[0]["content"] == "7+8\n"
    cot = dspy.ChainOfThought(Solve).predict.signature
    demo = {"problem": "1+2+3", "reasoning": "1+2\n=3\n3+3\n=6", "answer": 6}
    assert CompletionAdapter().format(cot, [demo], {"problem": "5+5"})[0]["content"] == (
        "1+2+3\n1+2\n=3\n3+3\n=6\n#### 6\n5+5\n"
    )
    two = CompletionAdapter().format(Explain, [], {"topic": "EAD", "level": "basic"})
    assert two[0]["content"] == "EAD\nbasic\n"


def test_parse_reads_the_answer_line_and_the_work_before_it() -> None:
    adapter = CompletionAdapter()
    cot = dspy.ChainOfThought(Solve).predict.signature
    assert adapter.parse(cot, "1+2\n=3\n#### 3\ntrailing") == {"reasoning": "1+2\n=3", "answer": 3}
    assert adapter.parse(Solve, "#### 12 apples") == {"answer": 12}  # first number, as extract_answer
    with pytest.raises(AdapterParseError, match="no '####' answer line"):  # cut off: never an answer
        adapter.parse(Solve, "work\n7-5-1=1\n")
    assert adapter.parse(Explain, "a\nb\n#### short") == {"notes": "a\nb", "summary": "short"}
    with pytest.raises(AdapterParseError, match="answer"):
        adapter.parse(Solve, "#### none here")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="answer_prefix"):
        CompletionAdapter(answer_prefix=" ")
    with pytest.raises(ValueError, match="max_demos"):
        CompletionAdapter(max_demos=-1)
    with pytest.raises(ValueError, match="missing input fields"):
        CompletionAdapter().format(Solve, [], {"question": "1+1"})
