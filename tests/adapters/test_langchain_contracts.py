"""What a LangChain user does with any LLM, done with ours: batches with a bad input, callbacks that add up,
pydantic and ``asdict`` round trips, token counts as billed, a cache key free of install paths."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult

from ead_llm import EAD, EAGER, EASD, EntropyAdaptiveLLM, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.evaluation.task import problems
from ead_llm.policies.controls import FixedBlockSwitching, OracleSwitching, RandomSwitching

PROMPTS = [p.prompt for p in problems("test", 3)]
ADDITIVE = ("prompt_tokens", "completion_tokens", "small_tokens", "large_tokens", "flops", "large_processed_tokens")


class Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.starts = 0
        self.ends: list[LLMResult] = []
        self.errors: list[BaseException] = []

    def on_llm_start(self, serialized: dict[str, Any], prompts: list[str], **kwargs: Any) -> None:
        self.starts += 1

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.ends.append(response)

    def on_llm_error(self, error: BaseException, **kwargs: Any) -> None:
        self.errors.append(error)


@pytest.fixture(scope="module")
def llm() -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM(max_tokens=120)


def test_a_batch_with_one_bad_input_returns_one_error_and_the_other_results(llm: EntropyAdaptiveLLM) -> None:
    too_long = "1" * (llm.shared_engine.max_positions or 0)
    inputs = [PROMPTS[0], too_long, PROMPTS[1], "bad \ud800 surrogate", PROMPTS[2]]
    recorder = Recorder()
    out = llm.batch(inputs, config={"callbacks": [recorder]}, return_exceptions=True)
    expected = llm.batch([PROMPTS[0], PROMPTS[1], PROMPTS[2]])
    assert [out[0], out[2], out[4]] == expected
    assert isinstance(out[1], ValueError) and "prompt has" in str(out[1])
    assert isinstance(out[3], ValueError) and "surrogate" in str(out[3])
    assert len(recorder.errors) == 2  # each bad input ran as its own run and reported its error
    again = asyncio.run(llm.abatch(inputs, return_exceptions=True))
    assert [again[0], again[2], again[4]] == expected and isinstance(again[1], ValueError)
    with pytest.raises(ValueError, match="prompt"):
        llm.batch(inputs)  # without return_exceptions the call fails, as LangChain's does


def test_per_prompt_on_llm_end_costs_add_up_to_the_call(llm: EntropyAdaptiveLLM) -> None:
    recorder = Recorder()
    result = llm.generate(PROMPTS, callbacks=[recorder])
    total = result.llm_output["cost"]  # type: ignore[index]
    assert len(recorder.ends) == 3
    for key in ADDITIVE:
        assert sum(end.llm_output["cost"][key] for end in recorder.ends) == total[key], key  # type: ignore[index]
    usage = result.llm_output["token_usage"]  # type: ignore[index]
    assert sum(end.llm_output["token_usage"]["total_tokens"] for end in recorder.ends) == usage["total_tokens"]  # type: ignore[index]
    for end, generation in zip(recorder.ends, result.generations, strict=True):
        assert end.llm_output["cost"] == generation[0].generation_info["cost"]  # type: ignore[index]


def test_a_streamed_call_reports_its_bill_at_the_end(llm: EntropyAdaptiveLLM) -> None:
    recorder = Recorder()
    text = "".join(llm.stream(PROMPTS[0], config={"callbacks": [recorder]}))
    (end,) = recorder.ends
    assert end.llm_output is not None and end.llm_output["cost"]["completion_tokens"] > 0
    assert end.llm_output["token_usage"]["prompt_tokens"] == len(llm.get_token_ids(PROMPTS[0]))
    assert text == llm.invoke(PROMPTS[0])

    async def streamed() -> str:
        return "".join([piece async for piece in llm.astream(PROMPTS[1], config={"callbacks": [recorder]})])

    assert asyncio.run(streamed()) == llm.invoke(PROMPTS[1])
    assert recorder.ends[-1].llm_output["cost"]["completion_tokens"] > 0  # type: ignore[index]


def test_a_bad_per_call_option_is_an_error_of_the_run(llm: EntropyAdaptiveLLM) -> None:
    recorder = Recorder()
    with pytest.raises(ValueError, match="temperature"):
        llm.invoke(PROMPTS[0], config={"callbacks": [recorder]}, temperature=-1.0)
    with pytest.raises(ValueError, match="policy"):
        asyncio.run(llm.ainvoke(PROMPTS[0], config={"callbacks": [recorder]}, policy="large"))
    assert recorder.starts == 2 and len(recorder.errors) == 2  # tracers saw both runs and their errors


@pytest.mark.parametrize(
    "policy",
    [
        EAD(threshold=0.1, window=2, min_dwell=3, lookahead=True),
        SmallOnly(),
        LargeOnly(),
        SpeculativeDecoding(gamma=3, adaptive_gamma=True),
        EASD(entropy_threshold=1.5, top_n=5),
        EAGER(theta=0.7, max_paths=3, decoder=EAD(threshold=0.05), extractor="hashes"),
        RandomSwitching(fraction=0.3, block=4, seed=2),
        FixedBlockSwitching(small_block=5, large_block=2),
        OracleSwitching(),
    ],
)
def test_pydantic_and_asdict_round_trips_rebuild_the_object(policy: Any) -> None:
    llm = EntropyAdaptiveLLM(policy=policy, temperature=0.5, stop=["\n\n"], max_tokens=33)
    dumped = llm.model_dump()
    assert dumped["policy"]["policy"] == policy.name
    rebuilt = EntropyAdaptiveLLM.model_validate(dumped)
    assert rebuilt.policy == policy and rebuilt.model_dump() == dumped
    assert EntropyAdaptiveLLM.model_validate_json(llm.model_dump_json()).policy == policy
    again = EntropyAdaptiveLLM(**llm.asdict())
    assert again.policy == policy and again.asdict() == llm.asdict()


def test_token_counts_are_what_the_engine_bills_and_the_cache_key_has_no_install_path(
    llm: EntropyAdaptiveLLM,
) -> None:
    billed = llm.generate([PROMPTS[0]]).llm_output["cost"]["prompt_tokens"]  # type: ignore[index]
    assert llm.get_num_tokens(PROMPTS[0]) == billed  # the start token included
    key = str(llm.asdict())
    assert "ead_llm/embedded" not in key and "/work" not in key and "ead_llm_version" in key
