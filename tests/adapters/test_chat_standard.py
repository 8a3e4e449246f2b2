"""ChatEntropyAdaptive against LangChain's standard chat-model suites (langchain-tests), tool calling and
structured output on.

A random pair cannot judge: where a test asserts what the model chose (the tool's argument ``3``, a
tool call when none is forced, unicode it was asked to repeat), it carries the suites' own
``xfail(reason=..., raises=AssertionError)``: an ``AssertionError`` is an expected failure, any other
exception (our plumbing) fails the test, and a pass shows as XPASS.
``tests/real/test_standard_smollm2.py`` runs the same suites on a real instruct model. Multimodal
input is flagged off; model override per call is not supported (one object, one pair).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ead_llm import EAD, ChatEntropyAdaptive
from ead_llm.core.grammar import JsonBounds
from tests.tiny_pairs import chat_pair


class _Params:
    @property
    def chat_model_class(self) -> type[ChatEntropyAdaptive]:
        return ChatEntropyAdaptive

    @property
    def chat_model_params(self) -> dict[str, Any]:
        small, large = chat_pair()
        # a random model never judges a string done: short strings end its structured answers within max_tokens
        bounds = JsonBounds(max_string_length=24)
        return {"small": small, "large": large, "policy": EAD(threshold=3.0, min_dwell=2), "json_bounds": bounds}

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestChatEntropyAdaptiveUnit(_Params, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        """The suite's standard parameters less ``api_key``: a local pair has no key to take."""
        params = dict(super().standard_chat_model_params)
        params.pop("api_key")
        return params


JUDGED = (
    "test_tool_calling",
    "test_tool_calling_async",
    "test_bind_runnables_as_tools",
    "test_agent_loop",
    "test_unicode_tool_call_integration",
    "test_json_mode",  # JSON mode constrains to any object: the keys asked for are the model's choice
)
"""Tests whose assertions check what the model chose."""


def judged(test: Callable[..., Any]) -> Callable[..., Any]:
    """``test`` marked so that an ``AssertionError`` (the model's choice differed) or a parse failure of an
    unconstrained answer is an expected failure and any other exception still fails it; a pass shows as
    XPASS."""
    if inspect.iscoroutinefunction(test):

        @functools.wraps(test)
        async def copy_async(*args: Any, **kwargs: Any) -> Any:
            return await test(*args, **kwargs)

        copy: Callable[..., Any] = copy_async
    else:

        @functools.wraps(test)
        def copy_sync(*args: Any, **kwargs: Any) -> Any:
            return test(*args, **kwargs)

        copy = copy_sync
    copy.pytestmark = [*getattr(test, "pytestmark", [])]  # type: ignore[attr-defined]
    reason = "asserts the model's judgement (a tiny or random model may choose otherwise); plumbing errors still fail"
    return pytest.mark.xfail(reason=reason, raises=(AssertionError, OutputParserException), strict=False)(copy)


def judged_suite(cls: type, names: tuple[str, ...] = JUDGED) -> type:
    """``cls`` with every test of ``names`` it has wrapped by :func:`judged`."""
    for name in names:
        test = getattr(cls, name, None)
        if test is not None:
            setattr(cls, name, judged(test))
    return cls


@judged_suite
class TestChatEntropyAdaptiveIntegration(_Params, ChatModelIntegrationTests):
    pass
