"""What a DSPy user does with any LM, done with ours: rollouts that differ, DSPy's context-window error,
per-call options, one temperature range, parse errors on cut-off outputs, streaming the answer field."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import dspy
import pytest
from dspy.utils.callback import BaseCallback
from dspy.utils.exceptions import AdapterParseError, ContextWindowExceededError

from ead_llm import CompletionAdapter, EntropyAdaptiveLLM, LargeOnly
from ead_llm.adapters.dspy_adapter import CompletionStreamListener
from ead_llm.evaluation.task import problems

PROBLEM = problems("test", 1)[0]


class Solve(dspy.Signature):
    """Work out the chain of additions and subtractions."""

    problem: str = dspy.InputField()
    answer: int = dspy.OutputField()


@pytest.fixture(scope="module", autouse=True)
def memory_cache():
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)
    yield
    dspy.configure_cache()


@pytest.fixture(scope="module")
def tiny(llama_paths) -> EntropyAdaptiveLLM:
    small, large = map(str, llama_paths)
    return EntropyAdaptiveLLM(small=small, large=large, prompt_format="text", max_tokens=12)


class Outputs(BaseCallback):
    def __init__(self) -> None:
        self.texts: list[str] = []

    def on_lm_end(self, call_id: str, outputs: Any, exception: Exception | None = None) -> None:
        if outputs:
            self.texts.append(outputs[0] if isinstance(outputs[0], str) else outputs[0]["text"])


def test_best_of_n_rollouts_are_distinct_samples(tiny: EntropyAdaptiveLLM) -> None:
    outputs = Outputs()
    best = dspy.BestOfN(dspy.Predict(Solve), N=4, reward_fn=lambda args, pred: 0.0, threshold=1.0)
    adapter = CompletionAdapter(answer_prefix="=", max_demos=0)
    # a random pair rarely writes an answer line; what matters is what each rollout sampled
    with dspy.context(lm=tiny, adapter=adapter, callbacks=[outputs]), contextlib.suppress(Exception):
        best(problem="12+35")
    assert len(outputs.texts) == 4 and len(set(outputs.texts)) == 4  # four rollouts, four different samples


def test_a_rollout_repeats_itself_and_temperature_zero_ignores_it(tiny: EntropyAdaptiveLLM) -> None:
    def text(lm: EntropyAdaptiveLLM) -> str:
        return lm("12+35=", cache=False)[0]

    hot = [text(tiny.copy(rollout_id=k, temperature=1.0)) for k in range(3)]
    assert len(set(hot)) == 3 and text(tiny.copy(rollout_id=1, temperature=1.0)) == hot[1]
    with pytest.warns(UserWarning, match="rollout_id has no effect when temperature=0"):  # DSPy says so too
        cold = {text(tiny.copy(rollout_id=k, temperature=0.0)) for k in range(3)}
    assert len(cold) == 1  # greedy: the same text whatever the rollout


def test_an_overlong_prompt_is_dspys_context_window_error() -> None:
    lm = EntropyAdaptiveLLM(max_tokens=20)
    too_long = "1" * (lm.shared_engine.max_positions or 0)
    with pytest.raises(ContextWindowExceededError):
        lm(too_long, cache=False)
    with pytest.raises(ContextWindowExceededError), dspy.context(lm=lm, adapter=CompletionAdapter(max_demos=0)):
        dspy.Predict(Solve)(problem=too_long)  # what ReAct catches to shorten its trajectory
    with pytest.raises(ContextWindowExceededError):
        asyncio.run(lm.acall(too_long, cache=False))


def test_a_per_call_policy_reaches_the_engine_and_the_history() -> None:
    lm = EntropyAdaptiveLLM(max_tokens=200)
    (text,) = lm(PROBLEM.prompt, policy=LargeOnly(), cache=False)
    assert text == lm.invoke(PROBLEM.prompt, policy=LargeOnly())
    assert lm.history[-1]["ead_cost"]["large_fraction"] == 1.0
    with pytest.raises(ValueError, match="policy must be a policy object"):
        lm(PROBLEM.prompt, policy="large")


def test_one_temperature_range_through_every_door() -> None:
    lm = EntropyAdaptiveLLM(max_tokens=8)
    for bad in (lambda: EntropyAdaptiveLLM(temperature=2.5), lambda: lm.invoke("1", temperature=3.0)):
        with pytest.raises(ValueError, match=r"temperature must be in \[0.0, 2.0\]"):
            bad()
    assert lm.copy(temperature=2.0)("1234+5678\n", cache=False)  # the top of the range works in DSPy too


def test_a_cut_off_output_is_a_parse_error_not_an_answer() -> None:
    lm = EntropyAdaptiveLLM(max_tokens=15)  # stops inside the worked solution, before '#### N'
    with dspy.context(lm=lm, adapter=CompletionAdapter(max_demos=0)), pytest.raises(AdapterParseError):
        dspy.Predict(Solve)(problem=PROBLEM.prompt.strip())


def test_the_answer_field_streams_through_dspy() -> None:
    lm = EntropyAdaptiveLLM(max_tokens=200)
    program = dspy.streamify(
        dspy.Predict(Solve), stream_listeners=[CompletionStreamListener(signature_field_name="answer")]
    )

    async def run() -> tuple[list[str], Any]:
        chunks, final = [], None
        async for item in program(problem=PROBLEM.prompt.strip()):
            if isinstance(item, dspy.streaming.StreamResponse):
                chunks.append(item.chunk)
            elif isinstance(item, dspy.Prediction):
                final = item
        return chunks, final

    with dspy.context(lm=lm, adapter=CompletionAdapter(max_demos=0)):
        chunks, final = asyncio.run(run())
    assert final is not None and "".join(chunks).strip() == str(final.answer)  # the answer, as it streamed
