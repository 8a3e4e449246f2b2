"""ead-llm: a small and a large language model behaving as one cheaper large model."""

from ead_llm.chat_model import ChatEntropyAdaptive
from ead_llm.controls import FixedBlockSwitching, OracleSwitching, RandomSwitching
from ead_llm.dspy_adapter import CompletionAdapter
from ead_llm.eager import EAGER
from ead_llm.engine import Completion, Engine, Request
from ead_llm.ledger import Cost, Pricing
from ead_llm.llm import EntropyAdaptiveLLM
from ead_llm.loading import LoadConfig, ModelPair, load_pair
from ead_llm.policies import EAD, LargeOnly, Policy, SmallOnly
from ead_llm.sampling import SamplingParams
from ead_llm.speculative import EASD, SpeculativeDecoding
from ead_llm.tracking import CostTracker, track_cost
from ead_llm.types import FinishReason, Role, TokenEvent

__version__ = "0.1.0"

__all__ = [
    "EAD",
    "EAGER",
    "EASD",
    "ChatEntropyAdaptive",
    "Completion",
    "CompletionAdapter",
    "Cost",
    "CostTracker",
    "Engine",
    "EntropyAdaptiveLLM",
    "FinishReason",
    "FixedBlockSwitching",
    "LargeOnly",
    "LoadConfig",
    "ModelPair",
    "OracleSwitching",
    "Policy",
    "Pricing",
    "RandomSwitching",
    "Request",
    "Role",
    "SamplingParams",
    "SmallOnly",
    "SpeculativeDecoding",
    "TokenEvent",
    "load_pair",
    "track_cost",
]
