"""ead-llm: a small and a large language model behaving as one cheaper large model.

Every public name is importable from here; each is loaded on first use, so ``import ead_llm`` (and
``import ead_llm.core``) does not import torch's model code, LangChain or DSPy until a name that
needs them is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "ChatEntropyAdaptive": "ead_llm.adapters.langchain_chat",
    "CompletionAdapter": "ead_llm.adapters.dspy_adapter",
    "CompletionStreamListener": "ead_llm.adapters.dspy_adapter",
    "StrictJSONAdapter": "ead_llm.adapters.dspy_adapter",
    "Constraint": "ead_llm.core.grammar",
    "JsonBounds": "ead_llm.core.grammar",
    "EntropyAdaptiveLLM": "ead_llm.adapters.langchain_llm",
    "Cost": "ead_llm.accounting.ledger",
    "Pricing": "ead_llm.accounting.ledger",
    "CostTracker": "ead_llm.accounting.tracking",
    "track_cost": "ead_llm.accounting.tracking",
    "Completion": "ead_llm.core.request",
    "Request": "ead_llm.core.request",
    "SamplingParams": "ead_llm.core.request",
    "Engine": "ead_llm.core.engine",
    "LoadConfig": "ead_llm.core.loading",
    "ModelPair": "ead_llm.core.loading",
    "load_pair": "ead_llm.core.loading",
    "FinishReason": "ead_llm.core.types",
    "Role": "ead_llm.core.types",
    "TokenEvent": "ead_llm.core.types",
    "EAD": "ead_llm.policies.switching",
    "PolicyOptimizer": "ead_llm.optimize.policy_optimizer",
    "PolicySearchReport": "ead_llm.optimize.policy_optimizer",
    "apply_policies": "ead_llm.optimize.policy_optimizer",
    "LargeOnly": "ead_llm.policies.base",
    "Policy": "ead_llm.policies.base",
    "SmallOnly": "ead_llm.policies.base",
    "EASD": "ead_llm.policies.speculative",
    "SpeculativeDecoding": "ead_llm.policies.speculative",
    "EAGER": "ead_llm.policies.eager",
    "FixedBlockSwitching": "ead_llm.policies.controls",
    "OracleSwitching": "ead_llm.policies.controls",
    "RandomSwitching": "ead_llm.policies.controls",
    "QueryRouter": "ead_llm.policies.controls",
}

__all__ = [
    "EAD",
    "EAGER",
    "EASD",
    "ChatEntropyAdaptive",
    "Completion",
    "CompletionAdapter",
    "CompletionStreamListener",
    "Constraint",
    "Cost",
    "CostTracker",
    "Engine",
    "EntropyAdaptiveLLM",
    "FinishReason",
    "FixedBlockSwitching",
    "JsonBounds",
    "LargeOnly",
    "LoadConfig",
    "ModelPair",
    "OracleSwitching",
    "Policy",
    "PolicyOptimizer",
    "PolicySearchReport",
    "Pricing",
    "QueryRouter",
    "RandomSwitching",
    "Request",
    "Role",
    "SamplingParams",
    "SmallOnly",
    "SpeculativeDecoding",
    "StrictJSONAdapter",
    "TokenEvent",
    "apply_policies",
    "load_pair",
    "track_cost",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ead_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


if TYPE_CHECKING:
    from ead_llm.accounting.ledger import Cost, Pricing
    from ead_llm.accounting.tracking import CostTracker, track_cost
    from ead_llm.adapters.dspy_adapter import CompletionAdapter, CompletionStreamListener, StrictJSONAdapter
    from ead_llm.adapters.langchain_chat import ChatEntropyAdaptive
    from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
    from ead_llm.core.engine import Engine
    from ead_llm.core.grammar import Constraint, JsonBounds
    from ead_llm.core.loading import LoadConfig, ModelPair, load_pair
    from ead_llm.core.request import Completion, Request, SamplingParams
    from ead_llm.core.types import FinishReason, Role, TokenEvent
    from ead_llm.optimize.policy_optimizer import PolicyOptimizer, PolicySearchReport, apply_policies
    from ead_llm.policies.base import LargeOnly, Policy, SmallOnly
    from ead_llm.policies.controls import FixedBlockSwitching, OracleSwitching, QueryRouter, RandomSwitching
    from ead_llm.policies.eager import EAGER
    from ead_llm.policies.speculative import EASD, SpeculativeDecoding
    from ead_llm.policies.switching import EAD
