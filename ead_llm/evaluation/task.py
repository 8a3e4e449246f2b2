"""The embedded reasoning task: chains of multi-digit additions and subtractions, solved step by step.

A problem is one line, ``4821+3907-1568``. Its worked solution restates each step, adds or
subtracts column by column from the right with the carry (or borrow) written out, gathers the
step's result, and ends in a final-answer line::

    4821+3907
    1+7+0=8
    2+0+0=2
    8+9+0=17
    4+3+1=8
    =8728
    8728-1568
    8-8-0=0
    12-6-0=6
    7-5-1=1
    8-1-0=7
    =7160
    #### 7160

A subtraction column whose digit is too small borrows: it is written with a leading ``1``
(``12-6-0=6``) and the next column subtracts the borrow. Results never go negative.
Difficulty knobs: the number of steps and the operands' digit counts. Splits are disjoint by
construction: a problem's hash assigns it to train, dev or test, and each split's generator
keeps only its own problems.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from ead_llm.core.validation import check_int

Split = Literal["train", "dev", "test"]
SPLIT_SEEDS: dict[str, int] = {"train": 0, "dev": 1, "test": 2}
ALPHABET = "0123456789+-=#\n "
ANSWER_PREFIX = "#### "


@dataclass(frozen=True)
class Difficulty:
    """Size of the problems."""

    min_steps: int = 2
    """Fewest operations in a chain."""
    max_steps: int = 3
    """Most operations in a chain."""
    min_digits: int = 3
    """Fewest digits of an operand."""
    max_digits: int = 4
    """Most digits of an operand."""

    def __post_init__(self) -> None:
        check_int("min_steps", self.min_steps, minimum=1)
        check_int("max_steps", self.max_steps, minimum=self.min_steps)
        check_int("min_digits", self.min_digits, minimum=1)
        check_int("max_digits", self.max_digits, minimum=self.min_digits)


@dataclass(frozen=True)
class Problem:
    """One problem: the prompt the model sees, the worked solution it should write, the answer."""

    prompt: str
    solution: str
    answer: int


def column_add(x: int, y: int) -> tuple[list[str], int]:
    """Column lines of ``x + y`` from the right, and the sum."""
    xs, ys = str(x)[::-1], str(y)[::-1]
    lines, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        a = int(xs[i]) if i < len(xs) else 0
        b = int(ys[i]) if i < len(ys) else 0
        total = a + b + carry
        lines.append(f"{a}+{b}+{carry}={total}")
        carry = total // 10
    return lines, x + y


def column_sub(x: int, y: int) -> tuple[list[str], int]:
    """Column lines of ``x - y`` (``x >= y``) from the right, with borrows, and the difference."""
    if y > x:
        raise ValueError("column_sub needs x >= y")
    xs, ys = str(x)[::-1], str(y)[::-1]
    lines, borrow = [], 0
    for i in range(len(xs)):
        a = int(xs[i])
        b = int(ys[i]) if i < len(ys) else 0
        diff = a - b - borrow
        if diff < 0:
            lines.append(f"1{a}-{b}-{borrow}={diff + 10}")
            borrow = 1
        else:
            lines.append(f"{a}-{b}-{borrow}={diff}")
            borrow = 0
    return lines, x - y


def solve(first: int, ops: list[tuple[str, int]]) -> tuple[str, int]:
    """Worked solution and answer of ``first op1 y1 op2 y2 ...``."""
    lines: list[str] = []
    value = first
    for op, operand in ops:
        lines.append(f"{value}{op}{operand}")
        columns, value = column_add(value, operand) if op == "+" else column_sub(value, operand)
        lines.extend(columns)
        lines.append(f"={value}")
    lines.append(f"{ANSWER_PREFIX}{value}")
    return "\n".join(lines) + "\n", value


def _operand(rng: random.Random, difficulty: Difficulty) -> int:
    digits = rng.randint(difficulty.min_digits, difficulty.max_digits)
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def random_problem(rng: random.Random, difficulty: Difficulty) -> Problem:
    """Draw one problem (any split)."""
    value = first = _operand(rng, difficulty)
    ops: list[tuple[str, int]] = []
    for _ in range(rng.randint(difficulty.min_steps, difficulty.max_steps)):
        operand = _operand(rng, difficulty)
        if rng.random() < 0.5 and operand <= value:
            ops.append(("-", operand))
            value -= operand
        else:
            ops.append(("+", operand))
            value += operand
    prompt = str(first) + "".join(f"{op}{y}" for op, y in ops) + "\n"
    solution, answer = solve(first, ops)
    return Problem(prompt=prompt, solution=solution, answer=answer)


def split_of(prompt: str) -> Split:
    """The split a problem belongs to, from a hash of its text: 80% train, 10% dev, 10% test."""
    bucket = int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 10
    return "dev" if bucket == 8 else "test" if bucket == 9 else "train"


def problems(split: Split, n: int, *, seed: int = 0, difficulty: Difficulty | None = None) -> list[Problem]:
    """``n`` distinct problems of ``split``; the same arguments always give the same list."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be 'train', 'dev' or 'test', got {split!r}")
    check_int("n", n, minimum=0)
    check_int("seed", seed, minimum=0)
    difficulty = difficulty or Difficulty()
    rng = random.Random(f"ead-llm-task/{split}/{seed}")
    out: list[Problem] = []
    seen: set[str] = set()
    while len(out) < n:
        problem = random_problem(rng, difficulty)
        if split_of(problem.prompt) == split and problem.prompt not in seen:
            seen.add(problem.prompt)
            out.append(problem)
    return out


_COLUMN = re.compile(r"^(1?)(\d)([+-])(\d)[+-](\d)=(\d+)$")
_STEP = re.compile(r"^(\d+)([+-])(\d+)$")
_RESULT = re.compile(r"^=(\d+)$")


def _column_error(line: str, match: re.Match[str]) -> str | None:
    borrowed, a, op, b, c, d = match.groups()
    a_value, b_value, c_value, d_value = int(a) + (10 if borrowed else 0), int(b), int(c), int(d)
    if op == "+":
        return None if a_value + b_value + c_value == d_value and not borrowed else f"wrong column sum: {line}"
    return None if a_value - b_value - c_value == d_value else f"wrong column difference: {line}"


def consistency_errors(solution: str) -> list[str]:
    """What is internally wrong with a worked solution, without solving the problem again.

    Checks each column line's arithmetic, that each step starts from the previous step's result,
    that a step's result is made of its columns' digits, and that the answer line repeats the last
    result. An empty list means the work is consistent (not that the answer is right: a misread
    operand goes unnoticed).
    """
    errors: list[str] = []
    previous: int | None = None
    digits: list[str] = []
    last: int | None = None
    answer = extract_answer(solution)
    for raw in solution.splitlines():
        line = raw.strip()
        if not line or line.startswith("####"):
            continue
        if column := _COLUMN.match(line):
            if error := _column_error(line, column):
                errors.append(error)
            digits.append(column.group(6))
        elif step := _STEP.match(line):
            if previous is not None and int(step.group(1)) != previous:
                errors.append(f"step starts from {step.group(1)}, not the previous result {previous}")
            digits = []
        elif result := _RESULT.match(line):
            value = int(result.group(1))
            if digits:
                assembled = digits[-1] + "".join(d[-1] for d in reversed(digits[:-1]))
                if int(assembled) != value:
                    errors.append(f"result {value} does not match its columns ({int(assembled)})")
            previous = last = value
        else:
            errors.append(f"unreadable line: {line!r}")
    if answer is None:
        errors.append("no '#### answer' line")
    elif last is not None and answer != last:
        errors.append(f"answer {answer} is not the last result {last}")
    return errors


_ANSWER = re.compile(r"####\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d+")


def extract_answer(text: str) -> int | None:
    """The final answer in a model's output: the first ``#### N``; None when there is none.

    Copes with missing spaces, trailing text, several answer lines (the first counts) and
    garbage; it never raises.
    """
    if not isinstance(text, str):
        return None
    match = _ANSWER.search(text)
    if match is None:
        return None
    try:
        return int(match.group(1))
    except ValueError:
        return None


def is_correct(output: str, answer: int) -> bool:
    """Exact match of the extracted final answer."""
    return extract_answer(output) == answer


def accuracy(outputs: list[str], answers: list[int]) -> float:
    """Fraction of exact matches."""
    if len(outputs) != len(answers):
        raise ValueError(f"{len(outputs)} outputs but {len(answers)} answers")
    if not outputs:
        raise ValueError("accuracy of no outputs is undefined")
    return sum(is_correct(o, a) for o, a in zip(outputs, answers, strict=True)) / len(outputs)
