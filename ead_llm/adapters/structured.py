"""Structured output shared by the LangChain adapters: the schema of what is asked, the parser of the
answer, and LangChain's ``include_raw`` shape (``{"raw", "parsed", "parsing_error"}``)."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.output_parsers import JsonOutputParser
from langchain_core.output_parsers.pydantic import PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
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


def text_parser(schema: Any) -> Runnable:
    """Parses a JSON answer into ``schema``'s pydantic class, else into a dict."""
    return PydanticOutputParser(pydantic_object=schema) if is_pydantic(schema) else JsonOutputParser()


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
