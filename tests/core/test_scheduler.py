"""The shared engine under many callers: batching, fairness, limits, cancellation, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import pytest

from ead_llm import EAD, EAGER, EntropyAdaptiveLLM, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.evaluation.task import problems
from ead_llm.policies.speculative import SpecState

POLICIES = [EAD(threshold=0.05), SmallOnly(), LargeOnly(), EAD(threshold=0.2, min_dwell=3)]


def _mixed_requests(n: int) -> list[Request]:
    out = []
    for i, problem in enumerate(problems("test", n)):
        sampling = SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 0.8, seed=i)
        out.append(Request(problem.prompt, POLICIES[i % len(POLICIES)], sampling))
    return out


@pytest.fixture(scope="module")
def embedded_engine() -> Engine:
    return EntropyAdaptiveLLM().shared_engine


def test_concurrent_callers_get_their_single_caller_results(embedded_engine: Engine) -> None:
    requests = _mixed_requests(24)
    alone = [embedded_engine.generate([r])[0].token_ids for r in requests]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda r: embedded_engine.generate([r])[0].token_ids, requests))
    assert together == alone
    in_one_call = [c.token_ids for c in embedded_engine.generate(requests)]
    # in one call, request i draws from random stream i (its row), so only greedy rows must agree
    assert [a for a, r in zip(in_one_call, requests, strict=True) if r.sampling.temperature == 0] == [
        a for a, r in zip(alone, requests, strict=True) if r.sampling.temperature == 0
    ]


def test_async_callers_share_the_batch(embedded_engine: Engine) -> None:
    llm = EntropyAdaptiveLLM(max_tokens=60)
    prompts = [p.prompt for p in problems("test", 12)]
    expected = [llm.invoke(p) for p in prompts]

    async def all_at_once() -> list[str]:
        return list(await asyncio.gather(*(llm.ainvoke(p) for p in prompts)))

    assert asyncio.run(all_at_once()) == expected


def test_max_batch_bounds_the_running_set(llama_pair) -> None:
    engine = Engine(llama_pair, max_batch=2)
    requests = [
        Request("12+35=", SmallOnly(), SamplingParams(max_tokens=30, ignore_eos=True, seed=i)) for i in range(5)
    ]
    outputs = engine.generate(requests)  # five at once, in one call
    assert engine.scheduler.peak_running == 2 and all(len(o.token_ids) == 30 for o in outputs)
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


def test_kv_budget_admits_what_fits_and_refuses_what_never_can(llama_pair) -> None:
    engine = Engine(llama_pair, max_batch=8, kv_budget_tokens=80)
    request = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=30, ignore_eos=True))  # 7 + 30 positions
    assert [len(c.token_ids) for c in engine.generate([request] * 5)] == [30] * 5  # two at a time
    with pytest.raises(ValueError, match="kv_budget_tokens is 80"):
        engine.generate([Request("12+35=", SmallOnly(), SamplingParams(max_tokens=100))])
    with pytest.raises(ValueError, match="max_batch"):
        Engine(llama_pair, max_batch=0)


def test_closing_a_stream_cancels_and_frees_its_slots(llama_pair) -> None:
    engine = Engine(llama_pair, max_batch=4)
    long = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=200, ignore_eos=True))
    stream = engine.stream([long, long, long])
    first = [next(stream) for _ in range(3)]
    assert {e.index for e in first} == {0, 1, 2}
    stream.close()
    for _ in range(200):
        if engine.load["running"] == 0:
            break
        time.sleep(0.01)
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    short = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(c.token_ids) for c in engine.generate([short] * 4)] == [5] * 4


def test_a_failing_forward_fails_only_its_callers(llama_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    from ead_llm.core.types import Role

    engine = Engine(llama_pair, max_batch=8)
    small_request = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=40, ignore_eos=True))
    expected = engine.generate([small_request])[0].token_ids
    runner = engine.runners[Role.LARGE]

    def broken(rows):
        raise RuntimeError("injected large-model failure")

    monkeypatch.setattr(runner, "_run", broken)
    errors: list[BaseException] = []
    results = []

    def large_caller() -> None:
        try:
            engine.generate([Request("12+35=", LargeOnly(), SamplingParams(max_tokens=40))])
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=large_caller) for _ in range(2)]
    threads += [threading.Thread(target=lambda: results.append(engine.generate([small_request])[0].token_ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [str(e) for e in errors] == ["injected large-model failure"] * 2
    assert results == [expected]
    monkeypatch.undo()
    assert engine.generate([small_request])[0].token_ids == expected
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


def test_a_timeout_counts_the_wait_and_frees_the_queue(llama_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(llama_pair, max_batch=1)
    runner = engine.runners[Role.SMALL]
    original = runner._run
    inside, release = threading.Event(), threading.Event()

    def held(rows):  # the running request is held inside a pass until the waiting call has timed out
        inside.set()
        release.wait(timeout=30)
        return original(rows)

    monkeypatch.setattr(runner, "_run", held)
    long = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=20, ignore_eos=True))
    caller = threading.Thread(target=engine.generate, args=([long],))
    caller.start()
    assert inside.wait(timeout=30)
    with pytest.raises(TimeoutError, match=r"0\.2 s"):  # it waited in the queue, and that counts
        engine.generate([Request("1", SmallOnly(), SamplingParams(max_tokens=5))], timeout_s=0.2)
    assert engine.load["waiting"] in (0, 1)  # dropped from the queue at the scheduler's next look
    release.set()
    caller.join(timeout=30)
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


def test_close_stops_the_scheduler_and_a_later_call_restarts_it(llama_pair) -> None:
    engine = Engine(llama_pair, max_batch=2)
    request = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=5, ignore_eos=True))
    first = engine.generate([request])[0].token_ids
    thread = engine._thread
    assert engine.close() is True
    assert thread is not None and not thread.is_alive()
    assert engine.generate([request])[0].token_ids == first
    assert engine._thread is not thread and engine._thread is not None and engine._thread.is_alive()


@dataclass(frozen=True)
class _Broken(LargeOnly):
    """A policy whose choice raises after a few tokens (a bug in user code)."""

    name: ClassVar[str] = "broken_test_policy"

    def choose(self, state: object) -> Role:
        raise RuntimeError("broken policy")


@dataclass(frozen=True)
class _BrokenRound(SpeculativeDecoding):
    name: ClassVar[str] = "broken_round_test_policy"

    def begin_round(self, state: SpecState, budget: int) -> SpecState:
        raise RuntimeError("broken round")


def test_a_policy_that_raises_fails_its_callers_and_the_engine_serves_on(llama_pair) -> None:
    engine = Engine(llama_pair, max_batch=8)
    good = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=20, ignore_eos=True))
    expected = engine.generate([good])[0].token_ids
    for broken in (_Broken(), _BrokenRound()):
        with pytest.raises(RuntimeError, match="broken"):
            engine.generate([Request("12+35=", broken, SamplingParams(max_tokens=20))], timeout_s=30)
        # in one batch with good requests: only the broken one's caller fails
        errors: list[BaseException] = []
        bad = Request("12+35=", broken, SamplingParams(max_tokens=20))
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [
                pool.submit(_catch, errors, engine.generate, [bad]),
                *(pool.submit(engine.generate, [good]) for _ in range(3)),
            ]
            results = [f.result() for f in futures[1:]]
        assert len(errors) == 1 and [r[0].token_ids for r in results] == [expected] * 3
        assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    assert engine.generate([good])[0].token_ids == expected


def test_close_reports_a_thread_stuck_in_a_pass_and_the_next_call_waits_for_it(
    llama_pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(llama_pair, max_batch=2)
    request = Request("12+35=", SmallOnly(), SamplingParams(max_tokens=5, ignore_eos=True))
    expected = engine.generate([request])[0].token_ids
    runner = engine.runners[Role.SMALL]
    original = runner._run
    inside, release = threading.Event(), threading.Event()

    def stuck(rows):
        inside.set()
        release.wait(timeout=30)
        return original(rows)

    monkeypatch.setattr(runner, "_run", stuck)
    errors: list[BaseException] = []
    caller = threading.Thread(target=lambda: _catch(errors, engine.generate, [request]))
    caller.start()
    assert inside.wait(timeout=30)
    old = engine._thread
    assert engine.close(timeout_s=0.2) is False  # still inside the pass
    caller.join(timeout=30)
    assert [str(e) for e in errors] == ["the engine was closed"]  # the caller is not left waiting
    monkeypatch.undo()
    release.set()
    assert engine.generate([request])[0].token_ids == expected  # waited for the old thread, then a new one
    assert old is not None and not old.is_alive() and engine._thread is not old


def _catch(errors: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:
        errors.append(exc)


def test_the_load_is_idle_as_soon_as_a_call_returns(llama_pair) -> None:
    engine = Engine(llama_pair, max_batch=4)
    for policy in (SmallOnly(), LargeOnly(), EAD(threshold=0.2, min_dwell=3), SpeculativeDecoding(gamma=3)):
        engine.generate([Request("12+35=", policy, SamplingParams(max_tokens=9, ignore_eos=True))] * 3)
        assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}  # no waiting, no polling


def test_the_fast_token_event_is_the_dataclass() -> None:
    """``token_event`` (the scheduler's per-token constructor, which skips the frozen ``__init__``) takes exactly the
    class's fields and gives an event equal to the dataclass's own, still frozen."""
    import dataclasses
    import inspect

    from ead_llm.core.types import ForwardWork, Role, TokenEvent, token_event

    names = [f.name for f in dataclasses.fields(TokenEvent)]
    assert list(inspect.signature(token_event).parameters) == names
    fields = {
        "index": 3,
        "token_id": 7,
        "text": "ab",
        "role": Role.LARGE,
        "entropy": 0.25,
        "work": (ForwardWork(Role.SMALL, 2, 5),),
        "finish_reason": None,
        "counters": (("drafted_tokens", 2),),
        "path": 1,
        "prompt_tokens": 9,
        "cached_tokens": ((Role.LARGE, 16),),
        "branched_from": (0, 4),
    }
    fast = token_event(**fields)
    assert fast == TokenEvent(**fields) and hash(fast) == hash(TokenEvent(**fields))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.text = "c"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("large", "small", "waited", "hold", "held"),
    [
        (1, 4, 0, 1, True),  # few large rows beside small ones: wait for more
        (4, 4, 0, 1, True),
        (5, 4, 0, 1, False),  # more large rows than small: run now
        (2, 0, 0, 1, False),  # the step has nothing else to run
        (0, 4, 0, 1, False),
        (1, 4, 1, 1, False),  # one of them waited its step already
        (1, 4, 1, 2, True),
        (1, 4, 0, 0, False),  # holding turned off
    ],
)
def test_should_hold(large: int, small: int, waited: int, hold: int, held: bool) -> None:
    from ead_llm.core.scheduler import should_hold

    assert should_hold(large, small, waited, hold) is held


@pytest.mark.parametrize("hold", [1, 2])
def test_holding_the_large_pass_back_changes_no_token_and_no_bill(
    embedded_engine: Engine, hold: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests in one batch, EAD, speculative (greedy and sampled), EAGER's branching paths and the rest: with the
    large model's pass held back for fuller batches, every path's tokens, the model of each and the passes billed
    with each are what they are without; passes were held, and no row waited more than ``hold`` steps in a row."""
    from ead_llm.core import scheduler as module

    eager = EAGER(theta=0.2, max_paths=2, temperature=0.0, decoder=EAD(threshold=0.05))  # paths sharing a budget
    requests = [
        *_mixed_requests(12),
        *[
            Request(p.prompt, SpeculativeDecoding(gamma=3, adaptive_gamma=True), SamplingParams(max_tokens=40, **s))
            for p, s in zip(problems("test", 4), [{}, {"temperature": 0.8, "seed": 3}] * 2, strict=True)
        ],
        *[Request(p.prompt, eager, SamplingParams(max_tokens=60)) for p in problems("test", 12)],
    ]

    def streams() -> dict[tuple[int, int], list[tuple[int, str, list[tuple[str, int, int]]]]]:
        out: dict[tuple[int, int], list[tuple[int, str, list[tuple[str, int, int]]]]] = {}
        for event in embedded_engine.stream(requests):
            work = [(w.role.letter, w.tokens, w.past) for w in event.work]
            out.setdefault((event.index, event.path), []).append((event.token_id, event.role.letter, work))
        return out

    scheduler = embedded_engine.scheduler
    monkeypatch.setattr(scheduler, "prefix_caching", False)  # both runs start from the same (empty) cache
    monkeypatch.setattr(scheduler, "hold_large", 0)
    plain = streams()
    held, longest = [], []
    should_hold = module.should_hold

    def spy(large: int, small: int, waited: int, hold_: int) -> bool:
        answer = should_hold(large, small, waited, hold_)
        held.append(answer)
        longest.append(waited)
        return answer

    monkeypatch.setattr(module, "should_hold", spy)
    monkeypatch.setattr(scheduler, "hold_large", hold)
    gathered = streams()
    assert sum(held) > 0 and max(longest) <= hold
    assert sorted(plain) == sorted(gathered)  # the same paths
    assert [key for key in plain if plain[key] != gathered[key]] == []
