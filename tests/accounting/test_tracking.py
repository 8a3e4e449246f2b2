"""track_cost(): one bill for every call inside a block, across chains, threads, nesting and DSPy."""

from __future__ import annotations

import contextvars
import threading

import pytest
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnableParallel

from ead_llm import EAD, EntropyAdaptiveLLM, LargeOnly, track_cost


@pytest.fixture(scope="module")
def llm(llama_paths) -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM(
        small=str(llama_paths[0]), large=str(llama_paths[1]), policy=EAD(threshold=3.0, min_dwell=2), max_tokens=10
    )


def _cost(llm: EntropyAdaptiveLLM, prompt: str, **kwargs) -> dict:
    return llm.generate([prompt], **kwargs).llm_output["cost"]  # type: ignore[index]


def test_sums_every_call_in_a_nested_chain(llm: EntropyAdaptiveLLM) -> None:
    expected = [_cost(llm, p) for p in ("1+2=", "3+4=")] + [_cost(llm, "5+6=", policy=LargeOnly())]
    chain = RunnableParallel(
        a=PromptTemplate.from_template("1+{x}=") | llm,
        b=PromptTemplate.from_template("3+{y}=") | llm,
    ) | (lambda out: llm.invoke("5+6=", policy=LargeOnly()))
    with track_cost() as tracker:
        chain.invoke({"x": 2, "y": 4})
    assert tracker.calls == 3
    for key in ("prompt_tokens", "completion_tokens", "small_tokens", "large_tokens", "flops", "switches"):
        assert tracker.cost[key] == sum(c[key] for c in expected), key
    assert tracker.large_tokens == tracker.cost["large_tokens"]


def test_blocks_nest_and_outer_calls_stay_out_of_inner_blocks(llm: EntropyAdaptiveLLM) -> None:
    with track_cost() as outer:
        llm.invoke("1+2=")
        with track_cost() as inner:
            llm.invoke("3+4=")
        llm.invoke("5+6=")
    assert (outer.calls, inner.calls) == (3, 1)
    assert inner.completion_tokens == _cost(llm, "3+4=")["completion_tokens"]
    llm.invoke("7+8=")
    assert outer.calls == 3


def test_threads_batches_and_streams_are_counted(llm: EntropyAdaptiveLLM) -> None:
    prompts = [f"{i}+{i}=" for i in range(6)]
    with track_cost() as tracker:
        llm.batch(prompts, config={"max_concurrency": 2})  # LangChain worker threads
        workers = [threading.Thread(target=contextvars.copy_context().run, args=(llm.invoke, p)) for p in prompts[:3]]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        "".join(llm.stream("9+9="))
        llm.batch(prompts[:4], config={"max_concurrency": 2}, return_exceptions=True)  # a run per input, its threads
    assert tracker.calls == 3 + 3 + 1 + 4  # three batches of two, three threads, one stream, four runs
    expected = sum(_cost(llm, p)["completion_tokens"] for p in prompts + prompts[:3] + ["9+9="] + prompts[:4])
    assert tracker.completion_tokens == expected


def test_a_thread_outside_the_context_is_not_counted(llm: EntropyAdaptiveLLM) -> None:
    with track_cost() as tracker:
        worker = threading.Thread(target=llm.invoke, args=("1+2=",))
        worker.start()
        worker.join()
    assert tracker.calls == 0 and tracker.cost == {} and tracker.large_tokens == 0
