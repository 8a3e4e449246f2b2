"""EntropyAdaptiveLLM as a LangChain LLM on a tiny pair."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.prompts import PromptTemplate

from ead_llm import EAD, EntropyAdaptiveLLM, LargeOnly, Pricing, SmallOnly, SpeculativeDecoding


@pytest.fixture(scope="module")
def llm(llama_paths) -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM(
        small=str(llama_paths[0]), large=str(llama_paths[1]), policy=EAD(threshold=3.0, min_dwell=2), max_tokens=24
    )


def test_invoke_returns_text_and_is_deterministic(llm: EntropyAdaptiveLLM) -> None:
    text = llm.invoke("12+35=")
    assert isinstance(text, str) and text
    assert llm.invoke("12+35=") == text


def test_generate_reports_cost_per_completion_and_per_call(llm: EntropyAdaptiveLLM) -> None:
    result = llm.generate(["12+35=", "7*8="])
    infos = [g[0].generation_info for g in result.generations]
    assert all(i is not None for i in infos)
    costs = [i["cost"] for i in infos]  # type: ignore[index]
    for cost in costs:
        assert cost["small_tokens"] + cost["large_tokens"] == cost["completion_tokens"]
        assert set(cost) >= {
            "prompt_tokens",
            "completion_tokens",
            "small_tokens",
            "large_tokens",
            "large_fraction",
            "switches",
            "small_processed_tokens",
            "large_processed_tokens",
            "flops",
            "parameter_ratio",
            "wall_time_s",
        }
    assert result.llm_output is not None
    usage = result.llm_output["token_usage"]
    assert usage["completion_tokens"] == sum(c["completion_tokens"] for c in costs)
    assert usage["prompt_tokens"] == sum(c["prompt_tokens"] for c in costs) == 7 + 5  # BOS + characters
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    total = result.llm_output["cost"]
    assert total["flops"] == sum(c["flops"] for c in costs)
    assert total["large_tokens"] == sum(c["large_tokens"] for c in costs)
    assert total["large_fraction"] == pytest.approx(total["large_tokens"] / total["completion_tokens"])
    assert infos[0]["finish_reason"] in {"stop", "length"}  # type: ignore[index]
    assert len(infos[0]["models"]) == costs[0]["completion_tokens"]  # type: ignore[index]


def test_stop_is_honoured(llm: EntropyAdaptiveLLM) -> None:
    free = llm.invoke("7*8=", max_tokens=24)
    stop = free[4:6]
    cut = llm.invoke("7*8=", stop=[stop])
    assert cut == free[: free.index(stop)]
    with_default = llm.model_copy(update={"stop": [stop]})
    assert with_default.invoke("7*8=") == cut
    assert with_default.shared_engine is llm.shared_engine


def test_policy_and_sampling_override_per_call(llm: EntropyAdaptiveLLM) -> None:
    result = llm.generate(["12+35="], policy=SmallOnly())
    cost = result.generations[0][0].generation_info["cost"]  # type: ignore[index]
    assert cost["large_tokens"] == 0 and cost["large_processed_tokens"] == 0
    result = llm.generate(["12+35="], policy=LargeOnly(), max_tokens=5)
    cost = result.generations[0][0].generation_info["cost"]  # type: ignore[index]
    assert cost["small_tokens"] == 0 and cost["completion_tokens"] <= 5
    sampled = {llm.invoke("1", temperature=1.0, seed=s) for s in range(4)}
    assert len(sampled) > 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "large"}, "policy must be a policy object"),
        ({"temperature": -0.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"bogus": 1}, "unknown call options"),
    ],
)
def test_bad_call_options_are_refused(llm: EntropyAdaptiveLLM, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.invoke("1", **kwargs)
    assert llm.invoke("12+35=") == llm.invoke("12+35=")


def test_bad_constructor_arguments(llama_paths) -> None:
    paths = {"small": str(llama_paths[0]), "large": str(llama_paths[1])}
    with pytest.raises(ValueError, match="top_p"):
        EntropyAdaptiveLLM(**paths, top_p=1.5)
    with pytest.raises(ValueError, match="both small= and large="):
        EntropyAdaptiveLLM(small=paths["small"])
    with pytest.raises(ValueError, match="threshold"):
        EntropyAdaptiveLLM(**paths, policy=EAD(threshold=-1))
    with pytest.raises(ValueError, match="Extra inputs"):
        EntropyAdaptiveLLM(**paths, temprature=0.5)


def test_objects_share_one_engine(llm: EntropyAdaptiveLLM, llama_paths) -> None:
    other = EntropyAdaptiveLLM(small=str(llama_paths[0]), large=str(llama_paths[1]) + "/", policy=LargeOnly())
    assert other.shared_engine is llm.shared_engine


def test_exact_verification_is_an_engine_wide_setting(llm: EntropyAdaptiveLLM, llama_paths) -> None:
    paths = {"small": str(llama_paths[0]), "large": str(llama_paths[1])}
    engine = llm.shared_engine
    assert engine.exact_verification is False
    try:
        exact = EntropyAdaptiveLLM(**paths, exact_verification=True, policy=SpeculativeDecoding(gamma=3))
        assert exact.shared_engine is engine and engine.exact_verification is True
        assert EntropyAdaptiveLLM(**paths).shared_engine.exact_verification is True  # None keeps the engine's
        assert exact.invoke("12+3=", max_tokens=8) == llm.invoke("12+3=", policy=LargeOnly(), max_tokens=8)
        with pytest.raises(ValueError, match="exact_verification"):
            EntropyAdaptiveLLM(**paths, exact_verification=[1])
    finally:
        engine.exact_verification = False


def test_draft_bfloat16_is_for_a_draft_that_reads_its_targets_features(llm: EntropyAdaptiveLLM, llama_paths) -> None:
    """This pair's small model is an ordinary one: asking for its products in bfloat16 is refused, and says why."""
    paths = {"small": str(llama_paths[0]), "large": str(llama_paths[1])}
    assert llm.shared_engine.draft_bfloat16 is False
    with pytest.raises(ValueError, match="applies to a draft that reads its target's hidden states"):
        EntropyAdaptiveLLM(**paths, draft_bfloat16=True)
    with pytest.raises(ValueError, match="draft_bfloat16"):
        EntropyAdaptiveLLM(**paths, draft_bfloat16=[1])
    assert EntropyAdaptiveLLM(**paths, draft_bfloat16=False).shared_engine is llm.shared_engine


def test_prices_give_cost_usd(llama_paths) -> None:
    llm = EntropyAdaptiveLLM(
        small=str(llama_paths[0]),
        large=str(llama_paths[1]),
        policy=LargeOnly(),
        max_tokens=4,
        pricing=Pricing(large_input=1.0, large_output=3.0),
    )
    cost = llm.generate(["12"]).llm_output["cost"]  # type: ignore[index]
    assert cost["cost_usd"] == pytest.approx((cost["large_processed_tokens"] * 1.0 + cost["large_tokens"] * 3.0) / 1e6)


def test_stream_chunks_name_their_model(llm: EntropyAdaptiveLLM) -> None:
    tokens: list[tuple[str, Any]] = []

    class Recorder(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            tokens.append((token, kwargs.get("chunk")))

    chunks = list(llm.stream("12+35=", config={"callbacks": [Recorder()]}))
    assert "".join(chunks) == llm.invoke("12+35=")
    assert len(tokens) == len(chunks)
    models = "".join(chunk.generation_info["models"] for _, chunk in tokens)
    full = llm.generate(["12+35="]).generations[0][0].generation_info
    assert models == full["models"]  # type: ignore[index]
    assert tokens[-1][1].generation_info["cost"]["completion_tokens"] == len(tokens)


def test_in_a_chain_and_token_counting(llm: EntropyAdaptiveLLM) -> None:
    chain = PromptTemplate.from_template("{a}+{b}=") | llm
    assert chain.invoke({"a": 12, "b": 35}) == llm.invoke("12+35=")
    assert llm.get_num_tokens("12+35=") == 7  # as billed: the start token and six characters
    assert llm.batch(["1", "2"]) == [llm.invoke("1"), llm.invoke("2")]


class _CountingEngine:
    """Counts the shared engine's ``generate`` calls and the requests in each."""

    def __init__(self, llm: EntropyAdaptiveLLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        engine = llm.shared_engine
        original = engine.generate

        def generate(requests, *args: Any, **kwargs: Any):
            self.calls.append(len(requests))
            return original(requests, *args, **kwargs)

        monkeypatch.setattr(engine, "generate", generate)


def test_batch_reaches_one_engine_call(llm: EntropyAdaptiveLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _CountingEngine(llm, monkeypatch)
    outputs = llm.batch(["1", "2", "3"])
    assert counter.calls == [3]
    assert outputs == [llm.invoke(p) for p in ("1", "2", "3")]


async def test_async_invoke_and_stream_match_sync(llm: EntropyAdaptiveLLM) -> None:
    assert await llm.ainvoke("12+35=") == llm.invoke("12+35=")
    chunks = [chunk async for chunk in llm.astream("12+35=", policy=LargeOnly())]
    assert "".join(chunks) == llm.invoke("12+35=", policy=LargeOnly())
    assert await llm.abatch(["1", "2"]) == llm.batch(["1", "2"])


def test_langchain_cache_keys_include_per_call_options(llama_paths, monkeypatch: pytest.MonkeyPatch) -> None:
    from langchain_core.caches import InMemoryCache

    cached = EntropyAdaptiveLLM(
        small=str(llama_paths[0]), large=str(llama_paths[1]), max_tokens=8, cache=InMemoryCache()
    )
    counter = _CountingEngine(cached, monkeypatch)
    first = cached.invoke("12+35=")
    assert cached.invoke("12+35=") == first
    assert counter.calls == [1]  # the second call was a cache hit
    large = cached.invoke("12+35=", policy=LargeOnly())
    assert counter.calls == [1, 1]  # another policy is another cache entry, never the first answer
    assert large == cached.invoke("12+35=", policy=LargeOnly()) and counter.calls == [1, 1]
    assert cached.bind(policy=SmallOnly()).invoke("12+35=") == cached.invoke("12+35=", policy=SmallOnly())


def test_bind_sets_the_policy_and_refuses_bad_values(llm: EntropyAdaptiveLLM) -> None:
    result = llm.bind(policy=LargeOnly()).invoke("12+35=")
    assert result == llm.invoke("12+35=", policy=LargeOnly())
    with pytest.raises(ValueError, match="policy must be a policy object"):
        llm.bind(policy="large-only").invoke("12+35=")


def test_timeout_fails_the_call_and_frees_the_engine(llama_paths) -> None:
    paths = {"small": str(llama_paths[0]), "large": str(llama_paths[1])}
    slow = EntropyAdaptiveLLM(**paths, max_tokens=40, ignore_eos=True, timeout=1e-6)
    with pytest.raises(TimeoutError, match="timeout"):
        slow.invoke("12+35=")
    with pytest.raises(TimeoutError, match="timeout"):
        list(slow.stream("12+35="))
    fine = EntropyAdaptiveLLM(**paths, max_tokens=40, ignore_eos=True)
    assert len(fine.generate(["12+35="]).generations[0][0].generation_info["token_ids"]) == 40  # type: ignore[index]
    with pytest.raises(ValueError, match="timeout"):
        EntropyAdaptiveLLM(**paths, timeout=0)


def test_out_of_memory_is_retried_up_to_max_retries(llama_paths, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    llm = EntropyAdaptiveLLM(small=str(llama_paths[0]), large=str(llama_paths[1]), max_tokens=6, max_retries=1)
    expected = llm.invoke("12+35=")
    engine = llm.shared_engine
    original = engine.generate
    failures = {"left": 1}

    def flaky(*args: Any, **kwargs: Any):
        if failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", flaky)
    assert llm.invoke("12+35=") == expected
    failures["left"] = 2
    with pytest.raises(torch.OutOfMemoryError):
        llm.invoke("12+35=")


def test_pickling_stores_settings_not_weights(llm: EntropyAdaptiveLLM, llama_pair) -> None:
    import pickle

    from ead_llm import ChatEntropyAdaptive, Engine

    data = pickle.dumps(llm)
    assert len(data) < 50_000  # the two models' weights alone are megabytes
    restored = pickle.loads(data)
    assert restored.shared_engine is llm.shared_engine and restored.invoke("12+35=") == llm.invoke("12+35=")
    chat = ChatEntropyAdaptive(small=llm.small, large=llm.large)
    assert pickle.loads(pickle.dumps(chat)).shared_engine is llm.shared_engine
    with pytest.raises(TypeError, match="only shared engines can be pickled"):
        pickle.dumps(Engine(llama_pair))
