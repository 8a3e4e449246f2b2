"""Seeds: the same seed and inputs give the same text, whatever else runs and wherever the prompt stands in a
call. A sequence's random stream is its request's seed and sample index (the k-th of n uses stream k), never
its place in the call; checked for every policy at temperature 1 through invoke, batch, generate, the server
and DSPy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ead_llm import EAD, EAGER, EASD, EntropyAdaptiveLLM, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.policies.base import describe_policy
from ead_llm.policies.controls import FixedBlockSwitching, OracleSwitching, RandomSwitching
from ead_llm.serving.server import create_app

POLICIES = [
    SmallOnly(),
    LargeOnly(),
    EAD(threshold=0.3),
    EAD(threshold=0.3, window=1, min_dwell=1, lookahead=True),
    SpeculativeDecoding(gamma=3),
    EASD(gamma=3, entropy_threshold=0.5),
    RandomSwitching(fraction=0.4, block=3, seed=2),
    FixedBlockSwitching(small_block=3, large_block=2),
    OracleSwitching(),
    EAGER(theta=0.3, max_paths=3, budget_limit=1, decoder=SmallOnly(), temperature=1.0),
]
"""EAGER with ``budget_limit=1``: a prompt never borrows paths its call's other prompts left (with borrowing, by
design, a prompt's paths depend on the rest of its call)."""
P, Q, R = "12+35=", "The quick brown fox", "a+b="


@pytest.fixture(scope="module")
def llm(llama_paths: tuple[Path, Path]) -> EntropyAdaptiveLLM:
    """A random pair: its samples vary with the seed, so that holding the text fixed means something."""
    small, large = llama_paths
    return EntropyAdaptiveLLM(
        small=str(small), large=str(large), temperature=1.0, seed=7, max_tokens=24, prompt_format="text"
    )


@pytest.mark.parametrize(
    "policy", POLICIES, ids=lambda p: p.name + ("_lookahead" if getattr(p, "lookahead", 0) else "")
)
def test_a_prompt_gives_the_same_text_alone_and_anywhere_in_a_call(llm: EntropyAdaptiveLLM, policy: Any) -> None:
    alone = llm.invoke(P, policy=policy)
    assert llm.invoke(P, policy=policy) == alone  # and again
    assert llm.batch([Q, P], policy=policy)[1] == alone
    assert llm.batch([P, Q, R], policy=policy)[0] == alone
    assert llm.batch([Q, R, P], policy=policy, return_exceptions=True)[2] == alone
    assert llm.generate([R, Q, P], policy=policy).generations[2][0].text == alone
    with TestClient(create_app(llm)) as client:
        body = {"temperature": 1.0, "seed": 7, "max_tokens": 24, "policy": describe_policy(policy)}
        choices = client.post("/v1/completions", json={**body, "prompt": [Q, P]}).json()["choices"]
        assert choices[1]["text"] == alone
        if not policy.votes:  # n samples: the first is the prompt's own stream
            samples = client.post("/v1/completions", json={**body, "prompt": P, "n": 3}).json()["choices"]
            assert samples[0]["text"] == alone and len({c["text"] for c in samples}) == 3
    lm = llm.copy(policy=policy)
    assert lm(P, cache=False)[0] == alone
    if not policy.votes:
        assert lm(P, n=3, cache=False)[0] == alone
    assert llm.invoke(P, policy=policy, seed=8) != alone  # the seed matters: the checks above are not vacuous
