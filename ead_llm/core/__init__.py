"""The engine: loading, the scheduler, the model runner over a paged KV cache, the sampler and the
rejection sampler, output processing. Imports no framework (LangChain, DSPy, LiteLLM).

Its main names are importable from here, each loaded on first use (the modules import one another).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Completion": "ead_llm.core.request",
    "Engine": "ead_llm.core.engine",
    "AsyncEventStream": "ead_llm.core.streams",
    "EventStream": "ead_llm.core.streams",
    "FinishReason": "ead_llm.core.types",
    "LoadConfig": "ead_llm.core.loading",
    "ModelPair": "ead_llm.core.loading",
    "Request": "ead_llm.core.request",
    "Role": "ead_llm.core.types",
    "SamplingParams": "ead_llm.core.request",
    "TokenEvent": "ead_llm.core.types",
    "load_pair": "ead_llm.core.loading",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ead_llm.core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
