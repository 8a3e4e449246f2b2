"""``Engine(return_hidden_states=True)``: each completion carries the large model's final hidden states at every
position fed to it, the states transformers computes over the whole text at once, whatever path wrote them
(a batch, the prefix cache, speculative rounds with rollbacks), and NaN where the large model never read."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ead_llm import EAD, EAGER, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.loading import ModelPair
from ead_llm.core.policy import Policy
from ead_llm.core.request import Completion, Request, SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time there was a very long prompt, longer than a block"]


@pytest.fixture(scope="module")
def engine(llama_pair: ModelPair) -> Engine:
    return Engine(llama_pair, return_hidden_states=True)


def _run(engine: Engine, policy: Policy, **sampling: object) -> list[Completion]:
    params = SamplingParams(max_tokens=12, **sampling)  # type: ignore[arg-type]
    return engine.generate([Request(p, policy, params) for p in PROMPTS])


@torch.inference_mode()
def _truth(path: Path, engine: Engine, done: Completion, prompt: str) -> torch.Tensor:
    """transformers' final hidden states over the prompt and answer at once, but the last token: [T - 1, H]."""
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([engine.encode(prompt) + list(done.token_ids)])
    return target.model(input_ids=ids).last_hidden_state[0, :-1]


def test_large_only_hands_back_transformers_hidden_states_and_the_prefix_cache_the_same(
    engine: Engine, llama_paths: tuple[Path, Path]
) -> None:
    first = _run(engine, LargeOnly())
    again = _run(engine, LargeOnly())  # the prompts' blocks now come from the prefix cache
    assert all(done.cost.large_cached_tokens > 0 for done in again)
    for prompt, done, repeat in zip(PROMPTS, first, again, strict=True):
        truth = _truth(llama_paths[1], engine, done, prompt)
        assert done.hidden_states is not None and done.hidden_states.shape == truth.shape
        assert torch.allclose(done.hidden_states, truth, atol=1e-4)
        assert repeat.hidden_states is not None and torch.allclose(repeat.hidden_states, truth, atol=1e-4)


def test_speculative_rounds_with_rollbacks_hand_back_the_same_states(engine: Engine) -> None:
    alone = _run(engine, LargeOnly())
    drafted = _run(engine, SpeculativeDecoding(gamma=4))
    assert any(d.cost.extra["accepted_tokens"] < d.cost.extra["drafted_tokens"] for d in drafted)
    for a, d in zip(alone, drafted, strict=True):
        assert a.token_ids == d.token_ids
        assert a.hidden_states is not None and d.hidden_states is not None
        assert torch.allclose(a.hidden_states, d.hidden_states, atol=1e-4)


def test_a_branched_paths_states_are_those_of_its_own_text(engine: Engine, llama_paths: tuple[Path, Path]) -> None:
    """EAGER's paths share their prefix's blocks (copied where written): the chosen path's states are those of
    its own text, prefix included."""
    done = _run(engine, EAGER(theta=1.0, max_paths=8, percentile=0.0, temperature=0.0), seed=0)
    assert any(d.paths > 1 and d.path > 0 for d in done)  # a branch, not the first path, was chosen somewhere
    for prompt, path in zip(PROMPTS, done, strict=True):
        truth = _truth(llama_paths[1], engine, path, prompt)
        assert path.hidden_states is not None and torch.allclose(path.hidden_states, truth, atol=1e-4)


def test_positions_the_large_model_never_read_are_nan(engine: Engine, llama_paths: tuple[Path, Path]) -> None:
    for policy in (EAD(threshold=math.inf), SmallOnly()):
        for prompt, done in zip(PROMPTS, _run(engine, policy), strict=True):
            truth = _truth(llama_paths[1], engine, done, prompt)
            states = done.hidden_states
            assert states is not None and states.shape == truth.shape
            read = ~states.isnan().any(-1)
            seen = int(read.sum())
            assert bool(read[:seen].all()) and seen < states.shape[0]  # a prefix was read, and not all of it
            assert torch.allclose(states[:seen], truth[:seen], atol=1e-4)


def test_off_by_default_and_a_bad_setting_is_refused(llama_pair: ModelPair) -> None:
    plain = Engine(llama_pair)
    try:
        assert _run(plain, LargeOnly())[0].hidden_states is None
    finally:
        plain.close()
    with pytest.raises(ValueError, match="return_hidden_states must be True or False"):
        Engine(llama_pair, return_hidden_states="yes")  # type: ignore[arg-type]
