"""ChatEntropyAdaptive against LangChain's standard chat-model suites (langchain-tests).

Tool calling, structured output and multimodal input are flagged off (the pair has none of them);
the suites skip those tests themselves. Model override per call is not supported (one object, one pair).
"""

from __future__ import annotations

from typing import Any

from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ead_llm import EAD, ChatEntropyAdaptive
from tests.tiny_pairs import chat_pair


class _Params:
    @property
    def chat_model_class(self) -> type[ChatEntropyAdaptive]:
        return ChatEntropyAdaptive

    @property
    def chat_model_params(self) -> dict[str, Any]:
        small, large = chat_pair()
        return {"small": small, "large": large, "policy": EAD(threshold=3.0, min_dwell=2)}

    @property
    def supports_model_override(self) -> bool:
        return False

    # the suites infer these from bind_tools/with_structured_output being overridden; ours are overridden
    # only to say what is missing, so the model declares them unsupported
    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_tool_choice(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False


class TestChatEntropyAdaptiveUnit(_Params, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        """The suite's standard parameters less ``api_key``: a local pair has no key to take."""
        params = dict(super().standard_chat_model_params)
        params.pop("api_key")
        return params


class TestChatEntropyAdaptiveIntegration(_Params, ChatModelIntegrationTests):
    pass
