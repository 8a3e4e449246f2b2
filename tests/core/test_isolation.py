"""One bad row fails alone: within one call, a fault in one request's pass, grammar, round, verification,
decoder or text fails that request only, and every other request's text is what it is alone. A fault
outside any row fails what runs and the engine serves on."""

from __future__ import annotations

from typing import Any

import pytest

from ead_llm import EAD, EAGER, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core import engine as engine_module
from ead_llm.core.engine import Engine
from ead_llm.core.grammar import Constraint
from ead_llm.core.output import OutputProcessor
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.policies.speculative import DraftVerifyDecoder
from ead_llm.testing.faults import InjectedFault, fail_passes

GOOD = ["12+35=", "The quick brown fox", "a+b=", "x=1\ny="]
BAD = "a poisoned prompt with a long tail"
"""Longer than every good prompt plus its answer, so its positions are its own."""
POLICIES = {
    "large_only": LargeOnly(),
    "ead": EAD(threshold=1.0, window=1, min_dwell=1),
    "speculative": SpeculativeDecoding(gamma=3),
    "eager": EAGER(theta=0.5, max_paths=3, budget_limit=1, decoder=SmallOnly(), temperature=0.8),
}
"""EAGER with ``budget_limit=1`` never borrows from other prompts, so a prompt's paths are its own."""


def requests(policy: Any, prompts: list[str], **sampling: Any) -> list[Request]:
    params = SamplingParams(**{"max_tokens": 10, "ignore_eos": True, "temperature": 0.8, "seed": 3, **sampling})
    return [Request(p, policy, params) for p in prompts]


def texts(results: list[Completion | BaseException]) -> list[str | type]:
    return [r.text if isinstance(r, Completion) else type(r) for r in results]


def alone(engine: Engine, policy: Any, prompts: list[str], **sampling: Any) -> list[str]:
    return [engine.generate(requests(policy, [p], **sampling))[0].text for p in prompts]


def is_bad(engine: Engine) -> Any:
    bad = engine.encode(BAD)
    return lambda ids: ids[: len(bad)] == bad


def assert_idle(engine: Engine) -> None:
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("role", ["large", "small"])
def test_a_failing_pass_fails_only_its_row(llama_pair, name: str, role: str) -> None:
    policy = POLICIES[name]
    if role == "small" and name == "large_only":
        policy = SmallOnly()
    engine = Engine(llama_pair, max_batch=32)
    expected = alone(engine, policy, GOOD)
    prompts = [GOOD[0], GOOD[1], BAD, GOOD[2], GOOD[3]]
    with fail_passes(engine, role=role, when=is_bad(engine)) as faults:
        out = engine.generate(requests(policy, prompts), return_exceptions=True)
    if faults.raised == 0:  # this policy never ran that model for the bad row (EAD starting small)
        assert all(isinstance(o, Completion) for o in out)
        return
    assert isinstance(out[2], InjectedFault)
    assert texts(out) == [expected[0], expected[1], InjectedFault, expected[2], expected[3]]
    assert engine.faults["failed_requests"] == 1
    assert_idle(engine)
    with pytest.raises(InjectedFault), fail_passes(engine, role=role, when=is_bad(engine)):
        engine.generate(requests(policy, prompts))  # without return_exceptions the call raises
    assert_idle(engine)
    assert alone(engine, policy, GOOD) == expected  # nothing left corrupted


def test_the_helper_refuses_a_wrong_role_and_restores_the_runner(llama_pair) -> None:
    engine = Engine(llama_pair)
    with pytest.raises(ValueError, match="role"), fail_passes(engine, role="medium"):  # type: ignore[arg-type]
        pass
    with fail_passes(engine, role="small") as faults, pytest.raises(InjectedFault):
        engine.generate(requests(SmallOnly(), ["1+1="]))
    assert faults.raised == 1
    assert engine.generate(requests(SmallOnly(), ["1+1="]))[0].text  # the runner is itself again


def test_a_broken_draft_round_fails_only_its_row(llama_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(llama_pair, max_batch=32)
    policy = SpeculativeDecoding(gamma=2)
    expected = alone(engine, policy, GOOD)
    bad = is_bad(engine)
    original = DraftVerifyDecoder.draft_round

    def draft_round(self: DraftVerifyDecoder, seq: Any) -> Any:
        if bad(seq.tokens):
            raise InjectedFault("a broken round")
        return original(self, seq)

    monkeypatch.setattr(DraftVerifyDecoder, "draft_round", draft_round)
    out = engine.generate(requests(policy, [*GOOD[:2], BAD, *GOOD[2:]]), return_exceptions=True)
    assert texts(out) == [*expected[:2], InjectedFault, *expected[2:]]
    assert_idle(engine)


def test_a_verification_that_raises_is_judged_row_by_row(llama_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(llama_pair, max_batch=32)
    policy = SpeculativeDecoding(gamma=2)
    expected = alone(engine, policy, GOOD)
    first_bad_position = len(engine.encode(BAD))
    original = engine_module.verify
    calls: list[int] = []

    def verify(batch: Any) -> Any:
        calls.append(len(batch.positions))
        if bool((batch.positions >= first_bad_position).any()):
            raise InjectedFault("verification broke on one round")
        return original(batch)

    monkeypatch.setattr(engine_module, "verify", verify)
    out = engine.generate(requests(policy, [*GOOD[:2], BAD, *GOOD[2:]]), return_exceptions=True)
    assert texts(out) == [*expected[:2], InjectedFault, *expected[2:]]
    assert max(calls) > 1 and 1 in calls  # a batched verification failed, then each round alone
    assert_idle(engine)


def test_a_stage_that_fails_for_every_batch_is_run_row_by_row_and_said_so(
    llama_pair, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A batched verification that raises whatever rows it holds (a fault of no row: a bug, not a bad request)
    still gives every request its text, row by row, but not silently: the engine logs a warning naming the error."""
    engine = Engine(llama_pair, max_batch=32)
    policy = SpeculativeDecoding(gamma=2)
    expected = alone(engine, policy, GOOD)
    original = engine_module.verify

    def verify(batch: Any) -> Any:
        if len(batch.positions) > 1:
            raise InjectedFault("verification broke on every batch")
        return original(batch)

    monkeypatch.setattr(engine_module, "verify", verify)
    assert texts(engine.generate(requests(policy, GOOD))) == expected
    warned = [r.getMessage() for r in caplog.records if r.name == "ead_llm.core.engine"]
    assert warned and all("where each row alone succeeded" in m and "every batch" in m for m in warned)
    assert_idle(engine)


def test_a_failing_decoder_fails_only_its_row(llama_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(llama_pair, max_batch=32)
    policy = EAD(threshold=1.0, window=1, min_dwell=1)
    expected = alone(engine, policy, GOOD)
    bad = is_bad(engine)
    decoder_type = type(policy.build_decoder(0, {}))
    original = decoder_type.on_token

    def on_token(self: Any, seq: Any, sample: Any, room: Any) -> Any:
        if bad(seq.tokens) and seq.generated == 3:
            raise InjectedFault("a decoder bug")
        return original(self, seq, sample, room)

    monkeypatch.setattr(decoder_type, "on_token", on_token)
    out = engine.generate(requests(policy, [*GOOD[:2], BAD, *GOOD[2:]]), return_exceptions=True)
    assert texts(out) == [*expected[:2], InjectedFault, *expected[2:]]
    assert_idle(engine)


@pytest.mark.parametrize("stop", [(), ("\n\n\n",)])
def test_a_failing_detokenizer_fails_only_its_row(llama_pair, monkeypatch: pytest.MonkeyPatch, stop: tuple) -> None:
    """Text is made on the caller's thread (no stop strings) or on the scheduler thread (stop strings)."""
    engine = Engine(llama_pair, max_batch=32)
    policy = SmallOnly()
    expected = alone(engine, policy, GOOD, stop=stop)
    bad = engine.encode(BAD)
    init, push = OutputProcessor.__init__, OutputProcessor.push

    def poisoned_init(self: OutputProcessor, tokenizer: Any, context: Any, stops: Any) -> None:
        init(self, tokenizer, context, stops)
        self.poisoned = list(context[: len(bad)]) == bad  # type: ignore[attr-defined]

    def poisoned_push(self: OutputProcessor, token_id: int, *, last: bool) -> str:
        if getattr(self, "poisoned", False):
            raise InjectedFault("cannot decode")
        return push(self, token_id, last=last)

    monkeypatch.setattr(OutputProcessor, "__init__", poisoned_init)
    monkeypatch.setattr(OutputProcessor, "push", poisoned_push)
    out = engine.generate(requests(policy, [*GOOD[:2], BAD, *GOOD[2:]], stop=stop), return_exceptions=True)
    assert texts(out) == [*expected[:2], InjectedFault, *expected[2:]]
    assert_idle(engine)


def test_a_broken_grammar_fails_only_its_row(gpt2_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(gpt2_pair, max_batch=32)
    good, poisoned = Constraint.json_object(), Constraint.json_schema({"type": "object"}, strict=False)
    prompts = ["The quick brown fox", "12 + 35 =", "def add(a, b):"]
    expected = alone(engine, SmallOnly(), prompts, constraint=good, ignore_eos=False)
    original = engine.grammars.start

    class Broken:
        """A matcher that cannot compute a mask (as one hitting an internal error would)."""

        def __init__(self, matcher: Any) -> None:
            self._matcher = matcher

        def __getattr__(self, name: str) -> Any:
            if name == "unsafe_compute_mask_ptr":
                raise InjectedFault("the matcher broke")
            return getattr(self._matcher, name)

    def start(constraint: Constraint, length: int) -> Any:
        grammar = original(constraint, length)
        if constraint == poisoned:
            grammar.matcher = Broken(grammar.matcher)
        return grammar

    monkeypatch.setattr(engine.grammars, "start", start)
    params = {"max_tokens": 10, "temperature": 0.8, "seed": 3}
    batch = [
        Request(prompts[0], SmallOnly(), SamplingParams(constraint=good, **params)),
        Request(BAD, SmallOnly(), SamplingParams(constraint=poisoned, **params)),
        *[Request(p, SmallOnly(), SamplingParams(constraint=good, **params)) for p in prompts[1:]],
    ]
    out = engine.generate(batch, return_exceptions=True)
    assert texts(out) == [expected[0], InjectedFault, *expected[1:]]
    assert_idle(engine)


@pytest.mark.parametrize("where", ["admit", "finish_step", "_step"])
def test_a_fault_outside_any_row_fails_what_runs_and_the_engine_serves_on(
    llama_pair, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    engine = Engine(llama_pair, max_batch=32)
    expected = alone(engine, LargeOnly(), GOOD)
    target = engine if where == "_step" else engine.scheduler
    original, left = getattr(target, where), [1]

    def faulty(*args: Any) -> Any:
        if left[0]:
            left[0] -= 1
            raise InjectedFault(f"{where} broke")
        return original(*args)

    monkeypatch.setattr(target, where, faulty)
    out = engine.generate(requests(LargeOnly(), GOOD), return_exceptions=True)
    assert left == [0] and all(isinstance(o, InjectedFault) for o in out), texts(out)
    assert_idle(engine)
    assert engine._thread is not None and engine._thread.is_alive()  # the scheduler thread serves on
    assert [c.text for c in engine.generate(requests(LargeOnly(), GOOD))] == expected
    assert_idle(engine)


def _hand_overs(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Every hand-over to a caller from now on (each a list of items)."""
    from ead_llm.core.scheduler import Call

    seen: list[list[Any]] = []
    put = Call.put
    monkeypatch.setattr(Call, "put", lambda self, items: seen.append(items) or put(self, items))
    return seen


def test_whole_completions_come_in_one_hand_over_and_streams_every_step(
    llama_pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generate`` reads whole completions: its items are handed over once, at the end, with the same texts as a
    stream, which gets them every step."""
    engine = Engine(llama_pair, max_batch=32)
    batch = requests(LargeOnly(), GOOD, temperature=0.0)
    seen = _hand_overs(monkeypatch)
    streamed = [event.text for event in engine.stream(batch[:1])]
    steps = engine.steps
    assert len(seen) == len(streamed) == 10  # one per step, the end marker with the last
    seen.clear()
    out = engine.generate(batch)
    assert len(seen) == 1 and len(seen[0]) == 10 * len(GOOD) + 1 and engine.steps - steps == 10
    assert out[0].text == "".join(streamed)
    assert_idle(engine)


def test_a_failure_in_a_whole_call_is_handed_over_at_once(llama_pair) -> None:
    """A request failing in a ``generate`` call ends the call in the step it fails (its held items are handed over
    with the failure), not when the others end: the call raises and the rest are cancelled within a step. With
    ``return_exceptions`` the others finish as they would alone, the failure handed over with them."""
    engine = Engine(llama_pair, max_batch=32)
    long = {"max_tokens": 300, "temperature": 0.0}
    expected = alone(engine, LargeOnly(), GOOD, **long)
    bad, failed_at = engine.encode(BAD), []

    def late(ids: list[int]) -> bool:
        if ids[: len(bad)] == bad and len(ids) > len(bad) + 3:  # a few tokens in: items are held by then
            failed_at.append(engine.steps)
            return True
        return False

    prompts = [GOOD[0], BAD, *GOOD[1:]]
    with pytest.raises(InjectedFault), fail_passes(engine, when=late):
        engine.generate(requests(LargeOnly(), prompts, **long))
    assert_idle(engine)
    assert engine.steps - failed_at[0] <= 2, "the call ran on after its failure"  # 300 if held to the end
    with fail_passes(engine, when=late):
        out = engine.generate(requests(LargeOnly(), prompts, **long), return_exceptions=True)
    assert texts(out) == [expected[0], InjectedFault, *expected[1:]]
    assert_idle(engine)


def test_closing_the_engine_hands_over_what_a_whole_call_finished(llama_pair) -> None:
    """An engine closed under a ``generate`` call whose first request has finished (its items held) still hands
    that answer over; the request still running fails with the closing."""
    import threading
    import time

    engine = Engine(llama_pair, max_batch=32)
    short, long = requests(LargeOnly(), GOOD[:1], max_tokens=3)[0], requests(LargeOnly(), GOOD[1:2], max_tokens=400)[0]
    expected = engine.generate([short])[0].text
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.extend(engine.generate([short, long], return_exceptions=True)))
    worker.start()
    deadline = time.monotonic() + 60
    while engine.load["running"] != 1:  # the short one retired, the long one decoding
        assert time.monotonic() < deadline and worker.is_alive(), engine.load
        time.sleep(0.001)
    engine.close()
    worker.join(60)
    assert [o.text if isinstance(o, Completion) else str(o) for o in out] == [expected, "the engine was closed"]
