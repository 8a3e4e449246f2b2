"""EntropyAdaptiveLLM as a DSPy LM, on the embedded pair (offline)."""

from __future__ import annotations

import copy
from typing import Any

import dspy
import pytest
from dspy.utils.callback import BaseCallback

from ead_llm import CompletionAdapter, EntropyAdaptiveLLM, LargeOnly, Pricing, SmallOnly
from ead_llm.evaluation.task import extract_answer, problems


class Solve(dspy.Signature):
    """Work out the chain of additions and subtractions."""

    problem: str = dspy.InputField()
    answer: int = dspy.OutputField()


@pytest.fixture(scope="module", autouse=True)
def memory_cache():
    """DSPy's cache in memory only, so no run reads answers another run left on disk."""
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)
    yield
    dspy.configure_cache()


@pytest.fixture(scope="module")
def llm() -> EntropyAdaptiveLLM:
    return EntropyAdaptiveLLM(max_tokens=200)


@pytest.fixture
def adapter() -> CompletionAdapter:
    return CompletionAdapter(max_demos=0)


PROBLEMS = problems("dev", 6)


class _EngineCalls:
    def __init__(self, llm: EntropyAdaptiveLLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = llm.shared_engine.generate

        def generate(*args: Any, **kwargs: Any):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(llm.shared_engine, "generate", generate)


def test_one_object_is_both_frameworks_models(llm: EntropyAdaptiveLLM) -> None:
    from langchain_core.language_models import BaseLLM

    assert isinstance(llm, dspy.LM) and isinstance(llm, BaseLLM)
    assert {llm: 1}[llm] == 1 and llm != llm.copy()
    assert llm.model == "ead-llm/embedded" and llm.model_type == "text"
    assert llm.kwargs["metadata"]["ead_llm_policy"].startswith("ead(")  # the policy in its own field
    prompt = PROBLEMS[0].prompt
    assert llm(prompt, cache=False) == [llm.invoke(prompt)]


def test_predict_and_chain_of_thought_read_the_pair_output(llm: EntropyAdaptiveLLM, adapter) -> None:
    problem = PROBLEMS[1]
    raw = llm.invoke(problem.prompt)
    with dspy.context(lm=llm, adapter=adapter):
        predicted = dspy.Predict(Solve)(problem=problem.prompt.strip())
        reasoned = dspy.ChainOfThought(Solve)(problem=problem.prompt.strip())
    assert predicted.answer == extract_answer(raw) == reasoned.answer
    assert isinstance(predicted.answer, int)
    assert reasoned.reasoning == raw[: raw.index("####")].strip()


def test_n_candidates_are_distinct_samples_and_reproducible(llm: EntropyAdaptiveLLM) -> None:
    prompt = PROBLEMS[2].prompt
    hot = llm.copy(policy=SmallOnly())
    first = hot(prompt, n=4, temperature=1.5, cache=False)
    assert len(first) == 4 and len(set(first)) > 1
    assert hot(prompt, n=4, temperature=1.5, cache=False) == first
    # candidate k draws from the seed's stream k; a prompt's place in a batch never matters, so the
    # first candidate is what the prompt gives alone and anywhere in a LangChain batch
    assert hot.invoke(prompt, temperature=1.5) == first[0]
    assert hot.batch([prompt] * 3, temperature=1.5) == [first[0]] * 3


def test_copy_shares_the_engine_and_isolates_history(llm: EntropyAdaptiveLLM) -> None:
    llm("1000+2000\n")
    copied = llm.copy(rollout_id=1, temperature=1.0)
    assert copied.shared_engine is llm.shared_engine
    assert copied.temperature == 1.0 and llm.temperature == 0.0
    assert copied.kwargs["rollout_id"] == 1 and "rollout_id" not in llm.kwargs
    assert copied.history == [] and llm.history
    assert copied.copy(rollout_id=None).kwargs.get("rollout_id") is None
    deep = copy.deepcopy(llm)
    assert deep.shared_engine is llm.shared_engine and deep is not llm
    program = dspy.Predict(Solve)
    program.lm = llm
    cloned = program.deepcopy()
    assert cloned.lm is not llm and cloned.lm.shared_engine is llm.shared_engine
    with pytest.raises(ValueError, match="engine"):
        llm.copy(engine="litellm")
    with pytest.raises(ValueError, match="temperature"):
        llm.copy(temperature=-1.0)


def test_kwargs_writes_reach_the_object(llm: EntropyAdaptiveLLM) -> None:
    copied = llm.copy()
    copied.kwargs["rollout_id"] = 7
    copied.kwargs["max_tokens"] = 50
    assert copied.kwargs["rollout_id"] == 7 and copied.max_tokens == 50 and llm.max_tokens == 200


def test_dspy_cache_hits_skip_the_engine_and_policies_never_share_entries(
    llm: EntropyAdaptiveLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _EngineCalls(llm, monkeypatch)
    prompt = PROBLEMS[3].prompt
    first = llm(prompt)
    assert llm(prompt) == first and calls.count == 1
    large = llm.copy(policy=LargeOnly())
    assert large.shared_engine is llm.shared_engine
    large(prompt)
    assert calls.count == 2
    uncached = llm.copy(cache=False)
    uncached(prompt)
    uncached(prompt)
    assert calls.count == 4


def test_usage_tracking_and_history_carry_the_bill() -> None:
    priced = EntropyAdaptiveLLM(max_tokens=200, pricing=Pricing(small_input=1.0, large_input=2.0, large_output=8.0))
    prompt = PROBLEMS[4].prompt
    with dspy.context(lm=priced, adapter=CompletionAdapter(max_demos=0), track_usage=True):
        prediction = dspy.Predict(Solve)(problem=prompt.strip())
    usage = prediction.get_lm_usage()[priced.model]
    entry = priced.history[-1]
    bill = entry["ead_cost"]
    assert usage["prompt_tokens"] == bill["prompt_tokens"] and usage["completion_tokens"] == bill["completion_tokens"]
    assert bill["small_tokens"] + bill["large_tokens"] == bill["completion_tokens"]
    assert entry["cost"] == pytest.approx(bill["cost_usd"]) and bill["cost_usd"] > 0
    expected = priced.generate([prompt]).llm_output["cost"]  # type: ignore[index]
    for key in ("completion_tokens", "large_tokens", "flops", "switches", "cost_usd"):
        assert bill[key] == expected[key], key


def test_evaluate_with_threads_matches_one_thread(llm: EntropyAdaptiveLLM, adapter) -> None:
    devset = [dspy.Example(problem=p.prompt.strip(), answer=p.answer).with_inputs("problem") for p in PROBLEMS]

    def metric(example: dspy.Example, prediction: dspy.Prediction, trace: Any = None) -> bool:
        return example.answer == prediction.answer

    program = dspy.Predict(Solve)
    uncached = llm.copy(cache=False)
    with dspy.context(lm=uncached, adapter=adapter):
        threaded = dspy.Evaluate(devset=devset, metric=metric, num_threads=4, display_progress=False)(program)
        single = dspy.Evaluate(devset=devset, metric=metric, num_threads=1, display_progress=False)(program)
    assert [r[1].answer for r in threaded.results] == [r[1].answer for r in single.results]
    assert threaded.score == single.score


async def test_async_calls_match_sync(llm: EntropyAdaptiveLLM, adapter) -> None:
    prompt = PROBLEMS[5].prompt
    assert await llm.acall(prompt, cache=False) == llm(prompt, cache=False)
    with dspy.context(lm=llm, adapter=adapter):
        predicted = await dspy.Predict(Solve).acall(problem=prompt.strip())
    assert predicted.answer == extract_answer(llm.invoke(prompt))


def test_dspy_callbacks_see_each_call(llm: EntropyAdaptiveLLM) -> None:
    seen: list[tuple[str, Any]] = []

    class Recorder(BaseCallback):
        def on_lm_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
            seen.append(("start", instance))

        def on_lm_end(self, call_id: str, outputs: Any, exception: Exception | None = None) -> None:
            seen.append(("end", outputs))

    with dspy.context(callbacks=[Recorder()]):
        outputs = llm("1234+5678\n", cache=False)
    assert seen == [("start", llm), ("end", outputs)]


def test_stream_events_rebuild_the_completion(llm: EntropyAdaptiveLLM) -> None:
    request = dspy.lm15.Request(model=llm.model, messages=(dspy.lm15.Message.user(PROBLEMS[0].prompt),))
    events = list(llm.engine.stream(request))
    response = llm.engine.complete(request)
    assert events[0].type == "start" and events[-1].type == "end"
    assert "".join(e.delta.text for e in events if e.type == "delta") == response.text
    assert events[-1].provider_data["cost"]["completion_tokens"] == response.usage.output_tokens


def test_unsupported_requests_say_what_to_use(llm: EntropyAdaptiveLLM) -> None:
    from dspy.utils.exceptions import LMUnsupportedFeatureError

    lm15 = dspy.lm15
    config = lm15.Config(tool_choice=lm15.ToolChoice(mode="required"))
    request = lm15.Request(model=llm.model, messages=(lm15.Message.user("1+1\n"),), config=config)
    with pytest.raises(LMUnsupportedFeatureError, match=r"cannot honour \['tool_choice'\]"):
        llm(request, cache=False)
    image = lm15.Request(model=llm.model, messages=(lm15.Message.user([lm15.ImagePart(url="https://x/y.png")]),))
    with pytest.raises(LMUnsupportedFeatureError, match="text turns"):
        llm(image, cache=False)
    assert llm("1+1\n", cache=False)  # the engine is fine afterwards


def test_state_round_trip(llm: EntropyAdaptiveLLM) -> None:
    tuned = llm.copy(policy=LargeOnly(), temperature=0.5, rollout_id=3, prompt_truncation="left", load_attempts=2)
    state = tuned.dump_state()
    restored = dspy.BaseLM.load_state(state, allow_custom_lm_class=True)
    assert isinstance(restored, EntropyAdaptiveLLM)
    assert restored.policy == LargeOnly() and restored.temperature == 0.5 and restored.kwargs["rollout_id"] == 3
    assert restored.prompt_truncation == "left" and restored.load_attempts == 2
    assert restored.shared_engine is llm.shared_engine


def test_stop_strings_reach_the_engine(llm: EntropyAdaptiveLLM) -> None:
    prompt = PROBLEMS[0].prompt
    (cut,) = llm(prompt, stop=["\n="], cache=False)
    assert cut == llm.invoke(prompt, stop=["\n="]) and "\n=" not in cut and len(cut) < len(llm.invoke(prompt))


async def test_streamify_streams_the_engine_tokens(llm: EntropyAdaptiveLLM, adapter) -> None:
    problem = PROBLEMS[1].prompt
    with dspy.context(lm=llm.copy(cache=False), adapter=adapter):
        streamed = dspy.streamify(dspy.Predict(Solve))
        items = [item async for item in streamed(problem=problem.strip())]
    chunks, final = items[:-1], items[-1]
    assert isinstance(final, dspy.Prediction) and final.answer == extract_answer(llm.invoke(problem))
    assert len(chunks) == len(llm.generate([problem]).generations[0][0].generation_info["token_ids"])  # type: ignore[index]


def test_chat_pair_messages_match_the_chat_model() -> None:
    from langchain_core.messages import HumanMessage, SystemMessage

    from ead_llm import ChatEntropyAdaptive
    from tests.tiny_pairs import chat_pair

    small, large = chat_pair()
    lm = EntropyAdaptiveLLM(small=small, large=large, max_tokens=8)
    chat = ChatEntropyAdaptive(small=small, large=large, max_tokens=8)
    assert lm.model_type == "chat" and lm.shared_engine is chat.shared_engine
    lm15 = dspy.lm15
    request = lm15.Request(model=lm.model, system="Be brief.", messages=(lm15.Message.user("hello"),))
    response = lm(request, cache=False)
    assert response.text == chat.invoke([SystemMessage("Be brief."), HumanMessage("hello")]).content
    assert copy.deepcopy(chat).shared_engine is chat.shared_engine
