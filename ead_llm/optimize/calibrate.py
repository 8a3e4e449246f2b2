"""``calibrate``: choose a pair's EAD threshold (and lookahead) from examples, and store it with the pair.

A threshold is a number in bits that depends on the pair (how sure its small model is) and on the text, so it
is measured, not guessed: each candidate runs the examples, and the cheapest (fewest large-model tokens) whose
outputs agree with LargeOnly's on ``target`` of the examples (``by="agreement"``), or whose metric keeps
``target`` of LargeOnly's score (``by=metric``), is chosen. Each lookahead setting scans its thresholds from the
highest (cheapest) down and stops at the first that reaches the target; an evaluation stops as soon as the
target is out of reach.

The choice is stored under ``~/.cache/ead-llm/calibration`` (``EAD_LLM_CALIBRATION_DIR`` to move it), keyed
by the pair as given, and ``EntropyAdaptiveLLM(small=..., large=...)`` without a policy starts on it; a pair
with none stored starts on speculative decoding, whose greedy text is LargeOnly's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ead_llm.accounting.tracking import track_cost
from ead_llm.core.validation import check_float, check_int
from ead_llm.optimize.search import candidate, cannot_reach, check_score, policy_text
from ead_llm.policies.base import LargeOnly, Policy, describe_policy, policy_from_description

THRESHOLDS = (0.8, 0.4, 0.2, 0.1, 0.05, 0.025, 0.0125)
"""Default EAD thresholds (bits) tried, highest (cheapest) first."""

Metric = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class CandidateRun:
    """One candidate's figures on the examples (``quality``: agreement or metric, None when stopped early)."""

    policy: dict[str, Any]
    quality: float | None
    large_tokens: int
    examples: int


@dataclass
class Calibration:
    """What :func:`calibrate` chose, with what it measured."""

    pair: dict[str, str]
    by: str
    target: float
    reached: bool
    policy: dict[str, Any] | None
    """The chosen policy's description (``policy_from_description``); None when no candidate reached the target."""
    quality: float | None
    """Agreement with LargeOnly, or the metric's share of LargeOnly's score, of the chosen policy."""
    large_tokens: int
    large_only_tokens: int
    examples: int
    runs: list[CandidateRun] = field(default_factory=list)
    search_cost: dict[str, Any] = field(default_factory=dict)
    wall_time_s: float = 0.0
    path: str | None = None
    """Where it was stored (None: not stored)."""

    @property
    def chosen(self) -> Policy | None:
        """The chosen policy as an object."""
        return None if self.policy is None else policy_from_description(self.policy)

    def table(self) -> str:
        """The calibration as lines of text: every candidate run, then the choice."""
        lines = [f"LargeOnly: {self.large_only_tokens} large tokens on {self.examples} examples"]
        for run in self.runs:
            p = run.policy
            setting = "lookahead" if p.get("lookahead") else f"window {p.get('window')}, dwell {p.get('min_dwell')}"
            quality = "stopped (target out of reach)" if run.quality is None else f"{self.by} {run.quality:.3f}"
            lines.append(
                f"  EAD {p.get('threshold')} bits, {setting}: {quality}, {run.large_tokens} large tokens "
                f"({run.examples} examples)"
            )
        if self.policy is None:
            lines.append(f"no setting reached {self.by} {self.target}: nothing stored")
        else:
            share = self.large_tokens / self.large_only_tokens if self.large_only_tokens else 0.0
            lines.append(
                f"chosen: {policy_text(self.policy)}, {self.by} {self.quality:.3f} at {share:.1%} of LargeOnly's "
                "large tokens" + (f"; stored in {self.path}" if self.path else "")
            )
        lines.append(f"search: {self.search_cost.get('large_tokens', 0)} large tokens, {self.wall_time_s:.1f} s")
        return "\n".join(lines)


def calibration_dir() -> Path:
    """Where calibrations are stored."""
    return Path(os.environ.get("EAD_LLM_CALIBRATION_DIR") or Path.home() / ".cache" / "ead-llm" / "calibration")


def pair_key(small: str, large: str) -> str:
    """The file name of a pair's calibration (the pair as given: a Hub id, a folder or a file)."""
    return hashlib.sha256(json.dumps([str(small), str(large)]).encode()).hexdigest()[:24] + ".json"


def stored_policy(small: str, large: str) -> Policy | None:
    """The calibrated policy stored for this pair, or None (none stored, or unreadable: a run re-calibrates)."""
    path = calibration_dir() / pair_key(small, large)
    try:
        record = json.loads(path.read_text())
        return policy_from_description(record["policy"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(calibration: Calibration, small: str, large: str) -> str:
    folder = calibration_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / pair_key(small, large)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(calibration), indent=2, default=str))
    partial.replace(path)  # atomic: a reader sees the old record or the new one
    return str(path)


def _pair_models(runnable: Any) -> list[Any]:
    """Every ead-llm model inside ``runnable`` (itself, or the steps of sequences, bindings and parallels)."""
    from ead_llm.adapters.pair_model import PairModel

    if isinstance(runnable, PairModel):
        return [runnable]
    return [model for part in _parts(runnable) for model in _pair_models(part)]


def _parts(runnable: Any) -> list[Any]:
    from langchain_core.runnables import RunnableBinding, RunnableParallel, RunnableSequence

    if isinstance(runnable, RunnableSequence):
        return list(runnable.steps)
    if isinstance(runnable, RunnableBinding):
        return [runnable.bound]
    if isinstance(runnable, RunnableParallel):
        return list(runnable.steps__.values())
    return []


def with_policy(runnable: Any, policy: Policy) -> Any:
    """A copy of ``runnable`` whose ead-llm models run ``policy`` (the models share their engine)."""
    from langchain_core.runnables import RunnableBinding, RunnableParallel, RunnableSequence

    from ead_llm.adapters.pair_model import PairModel

    if isinstance(runnable, PairModel):
        return runnable.model_copy(update={"policy": policy})
    if isinstance(runnable, RunnableSequence):
        return RunnableSequence(*(with_policy(step, policy) for step in runnable.steps), name=runnable.name)
    if isinstance(runnable, RunnableBinding):
        return runnable.model_copy(update={"bound": with_policy(runnable.bound, policy)})
    if isinstance(runnable, RunnableParallel):
        return RunnableParallel(steps__={k: with_policy(v, policy) for k, v in runnable.steps__.items()})
    return runnable


def calibrate(
    model: Any,
    examples: Sequence[Any],
    target: float = 0.95,
    by: str | Metric = "agreement",
    *,
    thresholds: Sequence[float] = THRESHOLDS,
    lookahead: Sequence[bool] = (True, False),
    store: bool = True,
    max_concurrency: int = 4,
) -> Calibration:
    """Choose the cheapest EAD setting for ``model``'s pair reaching ``target`` on ``examples``, and store it.

    ``model``: an ``EntropyAdaptiveLLM`` or ``ChatEntropyAdaptive``, or a LangChain runnable around one
    (``prompt | llm | parser``); ``examples``: its inputs. ``by="agreement"``: the share of examples whose output
    equals LargeOnly's; ``by=metric``: ``metric(example, output)`` (a bool or a number in [0, 1]) summed, as a
    share of LargeOnly's sum. Use greedy decoding (temperature 0) so agreement is well defined.
    """
    models = _pair_models(model)
    if not models:
        raise ValueError(
            "calibrate needs an EntropyAdaptiveLLM or ChatEntropyAdaptive, or a LangChain runnable built around one "
            f"(prompt | llm | parser); found none in {type(model).__name__}"
        )
    pairs = {(str(m.small), str(m.large)) for m in models}
    if len(pairs) > 1:
        raise ValueError(f"calibrate tunes one pair at a time; this runnable holds {len(pairs)}: {sorted(pairs)}")
    ((small, large),) = pairs
    if models[0].small is None:
        raise ValueError(
            "the embedded pair is calibrated already (ead_llm.embedded.recommended_policy()); "
            "calibrate a pair you pass as small= and large="
        )
    examples = list(examples)
    if not examples:
        raise ValueError("calibrate needs at least one example")
    check_float("target", target, minimum=0.0, maximum=1.0)
    check_int("max_concurrency", max_concurrency, minimum=1)
    if by != "agreement" and not callable(by):
        raise ValueError(f"by must be 'agreement' or a metric(example, output) -> bool or [0, 1]; got {by!r}")
    tried = [float(check_float("thresholds", t, minimum=0.0, allow_inf=True)) for t in thresholds]
    settings = list(dict.fromkeys(bool(x) for x in lookahead))
    if not tried or not settings:
        raise ValueError("thresholds and lookahead must each name at least one value")
    started = time.perf_counter()
    with track_cost() as tracker:
        reference, reference_tokens = _run(model, LargeOnly(), examples, max_concurrency)
        score_of = _scorer(by, examples, reference)
        best_reference = sum(score_of(i, out) for i, out in enumerate(reference))
        runs: list[CandidateRun] = []
        winners: list[CandidateRun] = []
        for setting in settings:
            for threshold in sorted(tried, reverse=True):
                run = _evaluate(
                    model,
                    candidate(threshold, lookahead=setting),
                    examples,
                    score_of,
                    best_reference,
                    target,
                    max_concurrency,
                )
                runs.append(run)
                if run.quality is not None and run.quality >= target - 1e-9:
                    winners.append(run)
                    break
    best = min(winners, key=lambda r: r.large_tokens) if winners else None
    result = Calibration(
        pair={"small": small, "large": large},
        by="agreement" if by == "agreement" else getattr(by, "__name__", "metric"),
        target=target,
        reached=best is not None,
        policy=None if best is None else best.policy,
        quality=None if best is None else best.quality,
        large_tokens=0 if best is None else best.large_tokens,
        large_only_tokens=reference_tokens,
        examples=len(examples),
        runs=runs,
        search_cost=tracker.cost,
        wall_time_s=time.perf_counter() - started,
    )
    if store and best is not None:
        result.path = _store(result, small, large)
    return result


def comparable(output: Any) -> Any:
    """What agreement compares: a chat message's content and tool calls (its ids and usage differ every call),
    any other output as it is."""
    from langchain_core.messages import BaseMessage

    if isinstance(output, BaseMessage):
        calls = [(c["name"], c["args"]) for c in getattr(output, "tool_calls", None) or []]
        return output.content, calls
    return output


def _scorer(by: str | Metric, examples: list[Any], reference: list[Any]) -> Callable[[int, Any], float]:
    if by == "agreement":
        return lambda i, output: float(
            not isinstance(output, BaseException) and comparable(output) == comparable(reference[i])
        )
    metric = by
    assert callable(metric)
    return lambda i, output: 0.0 if isinstance(output, BaseException) else check_score(metric(examples[i], output))


def _run(model: Any, policy: Policy, examples: list[Any], concurrency: int) -> tuple[list[Any], int]:
    """Outputs of ``model`` under ``policy`` on ``examples`` (an exception where one failed) and its large tokens."""
    with track_cost() as tracker:
        outputs = with_policy(model, policy).batch(
            examples, config={"max_concurrency": concurrency}, return_exceptions=True
        )
    return outputs, int(tracker.cost.get("large_tokens", 0))


def _evaluate(
    model: Any,
    policy: Policy,
    examples: list[Any],
    score_of: Callable[[int, Any], float],
    reference_score: float,
    target: float,
    concurrency: int,
) -> CandidateRun:
    """One candidate, in chunks of ``concurrency`` examples, stopped once ``target`` is out of reach."""
    scores: list[float] = []
    tokens = 0
    total = len(examples)
    floor = target * reference_score / total if total else 0.0  # the mean score the target asks for
    for start in range(0, total, concurrency):
        outputs, used = _run(model, policy, examples[start : start + concurrency], concurrency)
        tokens += used
        scores.extend(score_of(start + j, out) for j, out in enumerate(outputs))
        if len(scores) < total and cannot_reach(scores, total, floor):
            return CandidateRun(describe_policy(policy), None, tokens, len(scores))
    quality = sum(scores) / reference_score if reference_score else 1.0
    return CandidateRun(describe_policy(policy), quality, tokens, total)
