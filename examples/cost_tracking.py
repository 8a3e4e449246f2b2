"""Cost tracking: one bill for everything inside a block (LangChain and DSPy calls alike), in USD too.

Needs nothing beyond ead-llm: runs offline on the embedded pair; DSPy caches its calls in ~/.dspy_cache."""

from ead_llm import EntropyAdaptiveLLM, LargeOnly, Pricing, track_cost

# Prices per million tokens of each model (input = every position a model processed).
llm = EntropyAdaptiveLLM(pricing=Pricing(small_input=0.05, small_output=0.2, large_input=1.0, large_output=4.0))
prompts = ["1234+5678-999\n", "4821+3907-1568\n", "9876-5432+1111\n"]

with track_cost() as ead:
    llm.batch(prompts)  # LangChain
    llm("31415+2718-1000\n")  # the same object as a DSPy LM

with track_cost() as large:
    llm.batch(prompts, policy=LargeOnly())
    llm.copy(policy=LargeOnly())("31415+2718-1000\n")

for name, tracker in (("EAD", ead), ("LargeOnly", large)):
    bill = tracker.cost
    print(
        f"{name:10s} calls {tracker.calls}  tokens {bill['completion_tokens']:4d}  large fraction "
        f"{bill['large_fraction']:.2f}  FLOPs {bill['flops']:.3g}  USD {bill['cost_usd']:.6f}"
    )
print(f"EAD costs {ead.cost_usd / large.cost_usd:.0%} of LargeOnly here (DSPy cache hits cost nothing)")
