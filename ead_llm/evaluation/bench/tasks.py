"""Benchmark tasks: prompts with reference answers, split into dev and test, and a named extractor.

A task is the embedded arithmetic task (default) or a JSONL file with one ``{"prompt": ...,
"answer": ...}`` object per line (an optional ``"split": "dev" | "test"`` per line; lines without
it are assigned by a hash of the prompt, ``dev_fraction`` of them to dev). An output is right when
the extractor's answer equals the reference after :func:`normalize` (numbers compare by value), or,
with the ``contains`` scorer, when the reference occurs in it as a whole word or phrase.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ead_llm.core.validation import check_float, check_int
from ead_llm.evaluation.extract import EXTRACTORS, contains_answer, extract_final_answer, normalize
from ead_llm.evaluation.task import problems

CONTAINS = "contains"
SCORERS: tuple[str, ...] = (*EXTRACTORS, CONTAINS)
"""How a task scores an output: an extractor's answer equals the reference, or ``contains``."""


REGEX = "regex:"
"""``regex:PATTERN`` scores by the pattern's first match in the output (its first group when it has one)."""


def check_scorer(extractor: str) -> None:
    if isinstance(extractor, str) and extractor.startswith(REGEX):
        try:
            re.compile(extractor[len(REGEX) :])
        except re.error as exc:
            raise ValueError(f"extractor {extractor!r}: not a regular expression ({exc})") from None
        return
    if extractor not in SCORERS:
        raise ValueError(f"extractor must be one of {', '.join(SCORERS)} or regex:PATTERN; got {extractor!r}")


def regex_answer(pattern: str, text: str) -> str | None:
    """The first match of ``pattern`` in ``text`` (its first group when it has groups), or None."""
    match = re.search(pattern, text)
    if match is None:
        return None
    return match.group(1) if match.groups() else match.group(0)


@dataclass(frozen=True)
class Example:
    """One problem: the prompt and its reference answer (text)."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class BenchTask:
    """A task's dev and test problems and how outputs are scored."""

    name: str
    dev: tuple[Example, ...]
    test: tuple[Example, ...]
    extractor: str = "hashes"

    def __post_init__(self) -> None:
        check_scorer(self.extractor)

    def extract(self, text: str) -> str | None:
        """The normalized answer in an output, or None (EAGER's votes; ``contains`` votes on ``auto``)."""
        if self.extractor == CONTAINS:
            return extract_final_answer(text)
        if self.extractor.startswith(REGEX):
            found = regex_answer(self.extractor[len(REGEX) :], text)
        else:
            found = EXTRACTORS[self.extractor](text)
        return None if found is None else normalize(found)

    def score(self, text: str, answer: str) -> bool:
        """Whether ``text`` states ``answer``."""
        if self.extractor == CONTAINS:
            return contains_answer(text, answer)
        found = self.extract(text)
        return found is not None and found == normalize(answer)

    def limit(self, dev: int | None, test: int | None) -> BenchTask:
        """The first ``dev`` and ``test`` problems (None keeps a split whole)."""
        for name, value in (("dev", dev), ("test", test)):
            if value is not None:
                check_int(name, value, minimum=1)
        return BenchTask(self.name, self.dev[:dev], self.test[:test], self.extractor)


def embedded_task(dev: int = 100, test: int = 200, seed: int = 0) -> BenchTask:
    """The embedded pair's arithmetic task: ``dev`` and ``test`` problems of its disjoint splits."""
    check_int("dev", dev, minimum=1)
    check_int("test", test, minimum=1)

    def examples(split: str, n: int) -> tuple[Example, ...]:
        return tuple(Example(p.prompt, str(p.answer)) for p in problems(split, n, seed=seed))  # type: ignore[arg-type]

    return BenchTask("embedded-arithmetic", examples("dev", dev), examples("test", test), "hashes")


def hash_split(prompt: str, dev_fraction: float) -> str:
    """``"dev"`` or ``"test"`` from a hash of the prompt (stable across runs and machines)."""
    bucket = int(hashlib.sha256(prompt.encode()).hexdigest()[:12], 16) / 16**12
    return "dev" if bucket < dev_fraction else "test"


def jsonl_objects(path: Path, fields: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, object)`` for each non-blank line of a JSONL file (``where``: ``path:line``); a line that is not
    a JSON object is refused, saying it should hold ``fields``."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: each line must be an object with {fields}")
        yield where, record


def _read_jsonl(path: Path) -> list[tuple[Example, str | None]]:
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist: pass a JSONL file of {{'prompt', 'answer'}} lines")
    out: list[tuple[Example, str | None]] = []
    for where, record in jsonl_objects(path, "'prompt' and 'answer'"):
        prompt, answer, split = record.get("prompt"), record.get("answer"), record.get("split")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"{where}: 'answer' must be a string or a number, got {answer!r}")
        if split not in (None, "dev", "test"):
            raise ValueError(f"{where}: 'split' must be 'dev' or 'test' when given, got {split!r}")
        out.append((Example(prompt, str(answer)), split))
    if not out:
        raise ValueError(f"task file {str(path)!r} has no problems")
    return out


def load_jsonl_task(
    path: str | Path,
    *,
    extractor: str = "hashes",
    dev_path: str | Path | None = None,
    dev_fraction: float = 0.3,
) -> BenchTask:
    """A task from JSONL: dev problems from ``dev_path`` if given, else from lines marked
    ``"split": "dev"``, else a hash-chosen ``dev_fraction`` of the lines; the rest is test."""
    check_float("dev_fraction", dev_fraction, minimum=0.0, maximum=1.0, exclusive_minimum=True)
    check_scorer(extractor)
    records = _read_jsonl(Path(path))
    if dev_path is not None:
        dev = [example for example, _ in _read_jsonl(Path(dev_path))]
        test = [example for example, split in records if split != "dev"]
    else:
        marked = any(split is not None for _, split in records)
        chosen = [(e, s if marked else hash_split(e.prompt, dev_fraction)) for e, s in records]
        dev = [e for e, s in chosen if s == "dev"]
        test = [e for e, s in chosen if s != "dev"]
    if not dev or not test:
        raise ValueError(
            f"task {str(path)!r} needs problems in both splits (dev {len(dev)}, test {len(test)}): "
            'add lines, mark some with "split": "dev", or pass a dev file'
        )
    return BenchTask(Path(path).stem, tuple(dev), tuple(test), extractor)
