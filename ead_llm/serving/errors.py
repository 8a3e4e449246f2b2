"""OpenAI's error object, shared by the server and the Ray proxy middleware (no heavy imports: the proxy loads it)."""

from __future__ import annotations

from typing import Any


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API answers."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
