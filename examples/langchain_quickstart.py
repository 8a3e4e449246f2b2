"""LangChain quickstart: the embedded pair as an LLM in a chain, with streaming, batching and the bill.

Needs nothing beyond ead-llm: runs offline on the embedded pair, in a few seconds."""

from langchain_core.prompts import PromptTemplate

from ead_llm import EntropyAdaptiveLLM, LargeOnly

llm = EntropyAdaptiveLLM()  # the embedded default pair with the EAD settings chosen for it, offline
chain = PromptTemplate.from_template("{problem}\n") | llm

print(chain.invoke({"problem": "4821+3907-1568"}))

# Stream: each chunk says which model wrote it (S = small, L = large).
for chunk in llm.stream("4821+3907-1568\n"):
    print(chunk, end="", flush=True)
print()

# Batch: all prompts go to the engine in one call.
answers = chain.batch([{"problem": "1234+5678-999"}, {"problem": "9876-5432+1111"}])
print([a.splitlines()[-1] for a in answers])

# The bill of one call, and the same prompt with the large model only.
result = llm.generate(["4821+3907-1568\n"])
ead = result.llm_output["cost"]
print("which model wrote each token:", result.generations[0][0].generation_info["models"])
large = llm.generate(["4821+3907-1568\n"], policy=LargeOnly()).llm_output["cost"]
for name, cost in (("EAD", ead), ("LargeOnly", large)):
    print(
        f"{name:9s} large model wrote {cost['large_tokens']:3d} of {cost['completion_tokens']} tokens and read "
        f"{cost['large_processed_tokens']} positions; parameter ratio {cost['parameter_ratio']:.2f}, "
        f"FLOPs {cost['flops']:.3g}"
    )
# EAD saves the large model's decoding steps; to stay current its cache still reads (nearly) every
# position, in cheap batched catch-up passes, so FLOPs barely move while time per token drops.
