"""Fault injection for tests: make one model's forward pass fail for chosen rows.

``fail_passes(engine, role="large", when=...)`` is a context manager. Inside it, every pass of that
model over a batch that holds a row for which ``when(token_ids)`` is true raises :class:`InjectedFault`
(``token_ids``: the row's whole sequence so far, prompt included, as a list). The model runner then
does what it does with any failing pass: it runs the batch again in halves, down to single rows, so
the row that fails alone is the one ``when`` names and every other row's pass succeeds. Tests use it
to show that one bad row fails only its own request::

    with fail_passes(engine, role="large", when=lambda ids: ids[:3] == bad_prefix) as faults:
        results = engine.generate(requests, return_exceptions=True)
    assert faults.raised > 0
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ead_llm.core.types import Role

if TYPE_CHECKING:
    import torch

    from ead_llm.core.engine import Engine
    from ead_llm.core.model_runner import PassRow


class InjectedFault(RuntimeError):
    """The failure :func:`fail_passes` raises inside a model's pass."""


@dataclass
class FaultLog:
    """What :func:`fail_passes` did while it was active."""

    raised: int = 0
    """Passes that raised."""


@contextmanager
def fail_passes(
    engine: Engine,
    role: Literal["large", "small"] = "large",
    when: Callable[[list[int]], bool] | None = None,
) -> Iterator[FaultLog]:
    """Within the block, ``role``'s passes raise :class:`InjectedFault` when a row satisfies ``when`` (every
    pass when ``when`` is None). Yields a :class:`FaultLog`; the engine is as before once the block ends."""
    try:
        runner = engine.runners[Role(role)]
    except ValueError:
        raise ValueError(f"role must be 'large' or 'small', got {role!r}") from None
    if when is not None and not callable(when):
        raise ValueError(f"when must be a function of a row's token ids, or None, got {when!r}")
    log = FaultLog()
    original = runner._run

    def faulty(rows: Sequence[PassRow]) -> tuple[torch.Tensor, list[int]]:
        for row in rows:
            if when is None or when(list(row.tokens)):
                log.raised += 1
                raise InjectedFault(f"injected fault in the {role} model's pass")
        return original(rows)

    runner._run = faulty  # type: ignore[method-assign]
    try:
        yield log
    finally:
        del runner._run  # the class's method again
