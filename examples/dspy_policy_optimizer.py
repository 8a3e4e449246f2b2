"""DSPy: PolicyOptimizer gives each predictor of a program its own decoding policy, the cheapest that keeps the
program's metric within max_drop of LargeOnly's, then the choice is checked on held-out problems.

Needs nothing beyond ead-llm: runs offline on the embedded pair (about half a minute on two cores)."""

import dspy

from ead_llm import CompletionAdapter, EntropyAdaptiveLLM, LargeOnly, PolicyOptimizer, apply_policies, track_cost
from ead_llm.evaluation.task import Difficulty, problems

EASY = Difficulty(min_steps=2, max_steps=2, min_digits=3, max_digits=3)
HARD = Difficulty(min_steps=3, max_steps=3, min_digits=4, max_digits=4)


class TwoSolvers(dspy.Module):
    """One predictor for an easy problem, one for a hard one."""

    def __init__(self):
        super().__init__()
        self.easy = dspy.Predict("problem -> answer: int")
        self.hard = dspy.Predict("problem -> answer: int")

    def forward(self, easy, hard):
        return dspy.Prediction(easy=self.easy(problem=easy).answer, hard=self.hard(problem=hard).answer)


def share_right(example, prediction, trace=None):
    """The share of the example's two problems answered right (PolicyOptimizer needs a value in [0, 1])."""
    return ((prediction.easy == example.easy_answer) + (prediction.hard == example.hard_answer)) / 2


def examples(split, n):
    pairs = zip(problems(split, n, difficulty=EASY), problems(split, n, difficulty=HARD), strict=True)
    rows = [{"easy": e.prompt, "hard": h.prompt, "easy_answer": e.answer, "hard_answer": h.answer} for e, h in pairs]
    return [dspy.Example(**row).with_inputs("easy", "hard") for row in rows]


dspy.configure_cache(enable_disk_cache=False)  # the search's bill is its own, not an earlier run's
lm = EntropyAdaptiveLLM(max_tokens=400)
dspy.configure(lm=lm, adapter=CompletionAdapter(max_demos=0))
program = PolicyOptimizer(share_right, max_drop=0.02).compile(TwoSolvers(), trainset=examples("train", 16))
report = program.policy_report
print(report.table())

held_out = examples("test", 16)
evaluate = dspy.Evaluate(devset=held_out, metric=share_right, num_threads=8, max_errors=100)
fresh = lm.copy(cache=False)  # held out: every call computed and billed
for name, policies in (("LargeOnly", {"easy": LargeOnly(), "hard": LargeOnly()}), ("optimised", report.policies)):
    with track_cost() as tracker:
        score = evaluate(apply_policies(TwoSolvers(), policies, fresh)).score
    print(f"held out, {name}: metric {score:.1f}%, large tokens {tracker.large_tokens}")
