"""The embedded reasoning task: generator, splits, extractor and scorer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ead_llm.evaluation.task import (
    ANSWER_PREFIX,
    Difficulty,
    accuracy,
    column_add,
    column_sub,
    consistency_errors,
    extract_answer,
    is_correct,
    problems,
    solve,
    split_of,
)


def test_worked_example() -> None:
    solution, answer = solve(4821, [("+", 3907), ("-", 1568)])
    assert answer == 7160
    assert solution == (
        "4821+3907\n1+7+0=8\n2+0+0=2\n8+9+0=17\n4+3+1=8\n=8728\n"
        "8728-1568\n8-8-0=0\n12-6-0=6\n7-5-1=1\n8-1-0=7\n=7160\n#### 7160\n"
    )


@settings(max_examples=300, deadline=None)
@given(x=st.integers(0, 10**7), y=st.integers(0, 10**7))
def test_columns_compute_the_right_result(x: int, y: int) -> None:
    lines, total = column_add(x, y)
    assert total == x + y
    # digits of the result are the last digit of every column line, plus a final carry
    digits = [int(line.split("=")[1]) % 10 for line in lines]
    carry = int(lines[-1].split("=")[1]) // 10
    assert int(str(carry) + "".join(map(str, reversed(digits)))) == x + y
    hi, lo = max(x, y), min(x, y)
    lines, diff = column_sub(hi, lo)
    assert diff == hi - lo
    assert int("".join(line.split("=")[1] for line in reversed(lines))) == hi - lo


def test_generator_is_deterministic_and_seeded() -> None:
    assert problems("test", 50) == problems("test", 50)
    assert problems("test", 50, seed=1) != problems("test", 50)
    assert problems("dev", 10) == problems("dev", 30)[:10]


def test_splits_never_overlap() -> None:
    sets = {s: {p.prompt for p in problems(s, 400)} for s in ("train", "dev", "test")}  # type: ignore[arg-type]
    assert not sets["train"] & sets["dev"]
    assert not sets["train"] & sets["test"]
    assert not sets["dev"] & sets["test"]
    assert all(split_of(p) == "test" for p in sets["test"])
    assert len(sets["test"]) == 400  # distinct within a split


def test_problems_respect_difficulty_and_are_correct() -> None:
    difficulty = Difficulty(min_steps=3, max_steps=3, min_digits=2, max_digits=2)
    for problem in problems("train", 100, difficulty=difficulty):
        assert problem.prompt.count("+") + problem.prompt.count("-") == 3
        assert problem.answer == eval(problem.prompt)  # plain arithmetic on digits and +/-
        assert problem.answer >= 0
        assert problem.solution.endswith(f"{ANSWER_PREFIX}{problem.answer}\n")
        assert extract_answer(problem.solution) == problem.answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("...\n#### 7160\n", 7160),
        ("####7160", 7160),
        ("#### 12\n#### 13", 12),
        ("#### -5", -5),
        ("#### 42abc", 42),
        ("=8728\n####", None),
        ("no answer at all", None),
        ("", None),
        ("### 5", None),
        ("#### \n7", 7),
        ("\x00\ufffd#### 9", 9),
    ],
)
def test_extractor_copes_with_malformed_output(text: str, expected: int | None) -> None:
    assert extract_answer(text) == expected


@given(st.text())
def test_extractor_never_raises(text: str) -> None:
    result = extract_answer(text)
    assert result is None or isinstance(result, int)


def test_scoring() -> None:
    assert is_correct("x\n#### 10\n", 10)
    assert not is_correct("x\n#### 11\n", 10)
    assert not is_correct("x", 10)
    assert accuracy(["#### 1", "#### 2", "oops", "#### 4"], [1, 2, 3, 5]) == 0.5
    with pytest.raises(ValueError, match="outputs"):
        accuracy(["#### 1"], [1, 2])
    with pytest.raises(ValueError, match="no outputs"):
        accuracy([], [])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_steps": 0}, "min_steps"),
        ({"min_steps": 3, "max_steps": 2}, "max_steps"),
        ({"min_digits": 0}, "min_digits"),
    ],
)
def test_bad_difficulty(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Difficulty(**kwargs)


def test_bad_split_arguments() -> None:
    with pytest.raises(ValueError, match="split"):
        problems("val", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        problems("dev", -1)


def test_consistency_check_accepts_every_reference_solution() -> None:
    assert all(consistency_errors(p.solution) == [] for p in problems("dev", 200))


def test_consistency_check_names_each_kind_of_mistake() -> None:
    good = solve(4821, [("+", 3907), ("-", 1568)])[0]
    assert consistency_errors(good.replace("8+9+0=17", "8+9+0=16")) == [
        "wrong column sum: 8+9+0=16",
        "result 8728 does not match its columns (8628)",
    ]
    assert consistency_errors(good.replace("12-6-0=6", "12-6-0=5"))[0] == "wrong column difference: 12-6-0=5"
    assert consistency_errors(good.replace("8728-1568", "8729-1568")) == [
        "step starts from 8729, not the previous result 8728"
    ]
    assert consistency_errors(good.replace("=8728\n", "=8738\n"))[0] == "result 8738 does not match its columns (8728)"
    assert consistency_errors(good.replace("#### 7160", "#### 7161")) == ["answer 7161 is not the last result 7160"]
    assert consistency_errors(good.replace("#### 7160\n", "")) == ["no '#### answer' line"]
    assert consistency_errors("garbage\n#### 3")[0] == "unreadable line: 'garbage'"
