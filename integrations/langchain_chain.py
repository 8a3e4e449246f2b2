"""An LCEL chain on the embedded pair: prompt | llm | answer parser, run with batch and streaming.

python -m integrations.langchain_chain --problems 40
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnableLambda

from ead_llm import EntropyAdaptiveLLM, track_cost
from ead_llm.evaluation.task import extract_answer, problems


@dataclass
class ChainRun:
    problems: int
    accuracy: float
    streamed_chunks: int
    streamed_matches_batch: bool
    large_fraction: float
    calls: int
    cost: dict


def build_chain(llm: EntropyAdaptiveLLM):
    """problem text -> worked solution -> integer answer (None when the model wrote none)."""
    return PromptTemplate.from_template("{problem}\n") | llm | StrOutputParser() | RunnableLambda(extract_answer)


def run(n: int = 40, split: str = "test") -> ChainRun:
    llm = EntropyAdaptiveLLM(max_tokens=400)
    chain = build_chain(llm)
    items = problems(split, n)  # type: ignore[arg-type]
    inputs = [{"problem": p.prompt.strip()} for p in items]
    with track_cost() as tracker:
        answers = chain.batch(inputs, config={"max_concurrency": 8})
        # streaming through the whole chain: the parser passes text chunks on as the pair writes them
        text_chain = PromptTemplate.from_template("{problem}\n") | llm | StrOutputParser()
        chunks = list(text_chain.stream(inputs[0]))
    accuracy = sum(a == p.answer for a, p in zip(answers, items, strict=True)) / n
    return ChainRun(
        problems=n,
        accuracy=accuracy,
        streamed_chunks=len(chunks),
        streamed_matches_batch=extract_answer("".join(chunks)) == answers[0],
        large_fraction=tracker.cost["large_fraction"],
        calls=tracker.calls,
        cost=tracker.cost,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=40)
    args = parser.parse_args()
    result = run(args.problems)
    print(
        f"accuracy {result.accuracy:.1%} on {result.problems} test problems; large fraction "
        f"{result.large_fraction:.3f}; {result.calls} engine calls; streamed {result.streamed_chunks} chunks"
    )


if __name__ == "__main__":
    main()
