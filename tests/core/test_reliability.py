"""Faults and load: a failing pass is retried in smaller batches, a bad row fails only its request,
and many threads of mixed policies get exactly their single-thread results."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ead_llm import EAD, EAGER, EASD, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.policies.controls import RandomSwitching

PROMPTS = ["12+35=", "The quick brown fox", "a+b=", "x=1\ny=", "sum of a, b:", "99+1=", "Q: 3*4?", "hello"]


def _break_runner(engine: Engine, monkeypatch: pytest.MonkeyPatch, fault) -> None:
    """Make every pass of both models raise ``fault(rows)`` when it returns an exception."""
    for runner in engine.runners.values():
        original = runner._run

        def run(rows, original=original):
            exc = fault(rows)
            if exc is not None:
                raise exc
            return original(rows)

        monkeypatch.setattr(runner, "_run", run)


def _together(engine: Engine, requests: list[Request]) -> list[tuple[int, ...] | BaseException]:
    """Each request from its own thread, all at once (one engine batch); token ids or the error."""
    out: list[tuple[int, ...] | BaseException] = [()] * len(requests)
    barrier = threading.Barrier(len(requests))

    def call(i: int) -> None:
        barrier.wait()
        try:
            out[i] = engine.generate([requests[i]])[0].token_ids
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def test_out_of_memory_is_retried_in_smaller_batches(llama_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(llama_pair, max_batch=16)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = [Request(p, EAD(threshold=2.0, window=1, min_dwell=1), params) for p in PROMPTS]
    alone = [engine.generate([r])[0].token_ids for r in requests]
    sizes: list[int] = []

    def oom(rows):
        sizes.append(len(rows))
        return torch.OutOfMemoryError("CUDA out of memory (injected)") if len(rows) > 2 else None

    _break_runner(engine, monkeypatch, oom)
    assert _together(engine, requests) == alone
    assert max(sizes) > 2 and engine.faults["retried_passes"] > 0 and engine.faults["failed_requests"] == 0
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


def test_a_fault_in_one_request_leaves_the_others_correct(llama_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(llama_pair, max_batch=16)
    bad = engine.encode("a poisoned prompt")
    policies = [EAD(threshold=2.0, window=1, min_dwell=1), SpeculativeDecoding(gamma=3), SmallOnly(), LargeOnly()]
    requests = [
        Request(p, policies[i % 4], SamplingParams(max_tokens=15, temperature=0.7, seed=i))
        for i, p in enumerate(PROMPTS)
    ]
    alone = [engine.generate([r])[0].token_ids for r in requests]
    poisoned = Request(bad, LargeOnly(), SamplingParams(max_tokens=15))

    def fault(rows):
        if any(list(row.tokens[: len(bad)]) == bad for row in rows):
            return RuntimeError("injected fault in one request")
        return None

    _break_runner(engine, monkeypatch, fault)
    out = _together(engine, [*requests, poisoned])
    assert out[:-1] == alone
    assert isinstance(out[-1], RuntimeError) and "injected fault" in str(out[-1])
    assert engine.faults["failed_requests"] == 1
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    monkeypatch.undo()
    assert [engine.generate([r])[0].token_ids for r in requests] == alone  # nothing left corrupted


def test_a_model_that_always_fails_fails_every_request_and_frees_everything(
    llama_pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(llama_pair, max_batch=8)
    _break_runner(engine, monkeypatch, lambda rows: RuntimeError("broken model"))
    out = _together(engine, [Request(p, SmallOnly(), SamplingParams(max_tokens=4)) for p in PROMPTS[:5]])
    assert all(isinstance(o, RuntimeError) and str(o) == "broken model" for o in out)
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    assert all(cache.pool.used == 0 and cache.nbytes() == 0 for cache in engine.caches.values())


def _mixed(n: int, offset: int) -> list[Request]:
    policies = [
        EAD(threshold=2.0, window=1, min_dwell=1),
        EAD(threshold=2.0, window=1, min_dwell=1, lookahead=True),
        SmallOnly(),
        LargeOnly(),
        SpeculativeDecoding(gamma=3),
        EASD(entropy_threshold=1.0, gamma=2),
        RandomSwitching(fraction=0.3, block=2, seed=1),
        EAGER(theta=0.5, max_paths=2, decoder=SmallOnly()),
    ]
    out = []
    for k in range(n):
        i = offset + k
        sampling = SamplingParams(max_tokens=8 + i % 5, temperature=0.0 if i % 3 == 0 else 0.9, top_k=i % 4, seed=i)
        out.append(Request(PROMPTS[i % len(PROMPTS)] + str(i), policies[i % len(policies)], sampling))
    return out


@pytest.mark.slow  # 20 s: 400 requests; test_scheduler checks concurrent callers in the README suite
def test_eight_threads_of_fifty_mixed_requests_match_one_thread(llama_pair) -> None:
    engine = Engine(llama_pair, max_batch=16)
    caches = dict(engine.caches)
    work = [_mixed(50, 50 * t) for t in range(8)]
    alone = [[engine.generate([r])[0].token_ids for r in chunk] for chunk in work]

    def thread(chunk: list[Request]) -> list[tuple[int, ...]]:
        return [engine.generate([r])[0].token_ids for r in chunk]

    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(thread, work))
    assert together == alone
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    # the same caches served every call, and hold nothing now: every block came back
    assert all(engine.caches[role] is caches[role] and caches[role].pool.used == 0 for role in Role)
    assert engine.scheduler.peak_running > 1  # the threads' requests did share the batch


def test_overlong_prompts_are_refused_or_left_truncated(llama_pair) -> None:
    from ead_llm import EntropyAdaptiveLLM

    engine = Engine(llama_pair)
    limit = engine.max_positions
    assert limit == 512
    long_prompt = " ".join(str(i) for i in range(2000))
    with pytest.raises(ValueError, match="prompt_truncation='left'"):
        engine.generate([Request(long_prompt, SmallOnly(), SamplingParams(max_tokens=5))])
    params = SamplingParams(max_tokens=5, ignore_eos=True, prompt_truncation="left")
    (done,) = engine.generate([Request(long_prompt, SmallOnly(), params)])
    assert done.cost.prompt_tokens == limit - 5 and len(done.token_ids) == 5
    ids = engine.encode(long_prompt)
    kept = engine.prompt_ids(Request(long_prompt, SmallOnly(), params))
    bos = engine.tokenizer.bos_token_id
    assert kept[1:] == ids[-(limit - 6) :] and (kept[0] == bos if ids[0] == bos else kept[0] == ids[-(limit - 5)])
    # a prompt that fits is left alone; max_tokens beyond the context still keeps one prompt token
    assert engine.prompt_ids(Request("12+35=", SmallOnly(), params)) == engine.encode("12+35=")
    wide = SamplingParams(max_tokens=4000, prompt_truncation="left")
    assert len(engine.prompt_ids(Request(long_prompt, SmallOnly(), wide))) == 1
    with pytest.raises(ValueError, match="prompt_truncation must be 'error' or 'left'"):
        SamplingParams(prompt_truncation="right")  # type: ignore[arg-type]
    small, large = (m.info.source for m in (llama_pair.small, llama_pair.large))
    llm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=3)
    with pytest.raises(ValueError, match="prompt has"):
        llm.invoke(long_prompt)
    assert isinstance(llm.invoke(long_prompt, prompt_truncation="left"), str)
