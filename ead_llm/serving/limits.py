"""What the server takes from one request, and who may ask (no web framework imported: the CLI checks it first)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ead_llm.core.validation import check_int

BYTES_PER_TOKEN = 32
"""The default body limit allows a full context of prompt at this many bytes per token (JSON-escaped text runs
at about 4-8): ``max(1 MiB, 32 x context)``."""
DEFAULT_MAX_SEQUENCES = 64


@dataclass(frozen=True)
class ServerLimits:
    """What the server takes from one request, and who may ask."""

    max_request_bytes: int | None = None
    """Largest request body; None: ``max(1 MiB, 32 bytes x the context)``."""
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    """Most sequences one request may ask for (prompts x ``n``)."""
    api_key: str | None = None
    """When set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``."""
    allowed_origins: tuple[str, ...] = field(default=())
    """Origins browsers may call from (CORS); empty: no CORS headers."""

    def __post_init__(self) -> None:
        if self.max_request_bytes is not None:
            check_int("max_request_bytes", self.max_request_bytes, minimum=1)
        check_int("max_sequences", self.max_sequences, minimum=1)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string, or None for an open server")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))

    def body_limit(self, context: int | None) -> int:
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(2**20, BYTES_PER_TOKEN * (context or 0))
