"""Structured output shared by the LangChain adapters: the schema of what is asked, the parser of the
answer, and LangChain's ``include_raw`` shape (``{"raw", "parsed", "parsing_error"}``)."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticToolsParser
from langchain_core.output_parsers.pydantic import PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass

METHODS = ("json_schema", "function_calling", "json_mode")


def is_pydantic(schema: Any) -> bool:
    return isinstance(schema, type) and is_basemodel_subclass(schema)


def json_schema_of(schema: Any) -> dict[str, Any]:
    """The JSON schema of a pydantic class, TypedDict, JSON schema or OpenAI tool spec."""
    if isinstance(schema, dict) and schema.get("type") == "function" and "function" in schema:
        return schema["function"].get("parameters") or {"type": "object"}
    if is_pydantic(schema):
        return schema.model_json_schema() if hasattr(schema, "model_json_schema") else schema.schema()
    return convert_to_json_schema(schema)


CUT = (
    "the answer was cut by max_tokens (finish_reason='length') before the structured output was complete: "
    "raise max_tokens"
)


def _not_cut(answer: Any) -> Any:
    """The answer, unless it is a message cut by ``max_tokens`` (``OutputParserException``)."""
    if isinstance(answer, BaseMessage) and answer.response_metadata.get("finish_reason") == "length":
        raise OutputParserException(CUT, llm_output=str(answer.content))
    return answer


def text_parser(schema: Any) -> Runnable:
    """Parses a JSON answer into ``schema``'s pydantic class, else into a dict; a cut answer raises."""
    parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic(schema) else JsonOutputParser()
    return RunnableLambda(_not_cut) | parser


def tool_parser(schema: Any, name: str) -> Runnable:
    """Parses the first call of tool ``name`` into ``schema``'s pydantic class, else its arguments; an answer
    cut by ``max_tokens`` or without the call raises ``OutputParserException`` (never a silent None)."""

    def has_call(message: Any) -> Any:
        _not_cut(message)
        if isinstance(message, AIMessage) and not any(c["name"] == name for c in message.tool_calls):
            reasons = "; ".join(str(c.get("error")) for c in message.invalid_tool_calls)
            raise OutputParserException(
                f"the answer holds no call of {name!r}" + (f": {reasons}" if reasons else ""),
                llm_output=str(message.content),
            )
        return message

    parser = (
        PydanticToolsParser(tools=[schema], first_tool_only=True)
        if is_pydantic(schema)
        else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    )
    return RunnableLambda(has_call) | parser


def structured(llm: Runnable, parser: Runnable, include_raw: bool) -> Runnable:  # noqa: FBT001
    """``llm | parser``, or with ``include_raw`` the raw answer beside the parsed one (None and the error
    when parsing fails), as LangChain's chat models return it."""
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


def check_method(method: Any, allowed: tuple[str, ...] = METHODS) -> str:
    if method not in allowed:
        raise ValueError(f"method must be one of {list(allowed)}, got {method!r}")
    return method
