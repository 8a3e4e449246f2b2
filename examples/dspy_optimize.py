"""DSPy: the same object as a DSPy LM; a chain-of-thought program compiled by BootstrapFewShot and evaluated.

Needs nothing beyond ead-llm: runs offline on the embedded pair; DSPy caches its calls in ~/.dspy_cache."""

import dspy

from ead_llm import CompletionAdapter, EntropyAdaptiveLLM, LargeOnly
from ead_llm.evaluation.task import problems

lm = EntropyAdaptiveLLM(max_tokens=400)
# The embedded pair completes its own task format; CompletionAdapter maps signatures onto it.
# (Instruct pairs keep DSPy's default ChatAdapter.) It was trained without few-shot demos: max_demos=0.
dspy.configure(lm=lm, adapter=CompletionAdapter(max_demos=0), track_usage=True)


class Solve(dspy.Signature):
    """Work out the chain of additions and subtractions."""

    problem: str = dspy.InputField()
    answer: int = dspy.OutputField()


def to_example(p):
    return dspy.Example(problem=p.prompt.strip(), answer=p.answer).with_inputs("problem")


trainset = [to_example(p) for p in problems("train", 6, seed=7)]
devset = [to_example(p) for p in problems("dev", 20)]


def metric(example, prediction, trace=None):
    return example.answer == prediction.answer


program = dspy.ChainOfThought(Solve)
prediction = program(problem="4821+3907-1568")
print("answer:", prediction.answer, "| usage:", prediction.get_lm_usage())
print("bill of that call:", lm.history[-1]["ead_cost"])

# A large-model-only teacher bootstraps the demos (lm.copy shares the loaded pair).
optimiser = dspy.BootstrapFewShot(
    metric=metric, max_bootstrapped_demos=2, max_labeled_demos=0, teacher_settings={"lm": lm.copy(policy=LargeOnly())}
)
compiled = optimiser.compile(program, trainset=trainset)
evaluate = dspy.Evaluate(devset=devset, metric=metric, num_threads=4, display_progress=False)
print("dev accuracy:", evaluate(compiled).score)
