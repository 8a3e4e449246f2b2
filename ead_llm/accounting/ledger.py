"""The cost ledger: turns a sequence's token events into the cost dict of shared/API.md."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ead_llm.core.types import Role, TokenEvent
from ead_llm.core.validation import check_float

if TYPE_CHECKING:
    from ead_llm.core.loading import ModelInfo


def parameter_ratio(large_fraction: float, small_params: int, large_params: int) -> float:
    """The EAD paper's cost metric ``f_L + (1 - f_L) * P_S / P_L``."""
    if not 0.0 <= large_fraction <= 1.0:
        raise ValueError(f"large_fraction must be in [0, 1], got {large_fraction}")
    return large_fraction + (1.0 - large_fraction) * small_params / large_params


def forward_flops(
    *,
    new_tokens: int,
    past_tokens: int,
    non_embedding_params: int,
    num_layers: int,
    attention_width: int,
) -> int:
    """Forward FLOPs of one pass over ``new_tokens`` positions after ``past_tokens`` cached ones.

    Per position at context length ``c`` (itself included): ``2 * N`` for the matrix multiplies
    of the ``N`` non-embedding parameters, plus ``4 * layers * c * width`` for attention
    (``QK^T`` and the weighted sum of ``V``, ``2 * c * width`` each per layer), where ``width``
    is query heads times head size. Embedding and unembedding are excluded (Kaplan et al. 2020).
    """
    if new_tokens < 0 or past_tokens < 0:
        raise ValueError("token counts must be >= 0")
    dense = 2 * non_embedding_params * new_tokens
    # sum of context lengths past+1 .. past+new
    context_sum = new_tokens * past_tokens + new_tokens * (new_tokens + 1) // 2
    attention = 4 * num_layers * attention_width * context_sum
    return dense + attention


@dataclass(frozen=True)
class Pricing:
    """Prices in USD per million tokens for each model.

    A model's input price applies to every position it processed (prompt prefill, catch-up,
    fed-back tokens), its output price to every token it emitted. Positions fed again because the engine
    evicted a sequence's cache for other users (``recomputed_tokens``) are not charged: a bill never
    depends on the load. Prompt positions a model took from its prefix cache (``*_cached_tokens``) pay
    ``*_cached_input``; left at None they pay the input price, so that the bill does not depend on what earlier
    calls left in the cache either (set it, e.g. to 0 or to half the input price, to pass the saving on).
    """

    small_input: float = 0.0
    small_output: float = 0.0
    large_input: float = 0.0
    large_output: float = 0.0
    small_cached_input: float | None = None
    large_cached_input: float | None = None

    def __post_init__(self) -> None:
        for name in ("small_input", "small_output", "large_input", "large_output"):
            check_float(f"pricing.{name}", getattr(self, name), minimum=0.0)
        for name in ("small_cached_input", "large_cached_input"):
            if getattr(self, name) is not None:
                check_float(f"pricing.{name}", getattr(self, name), minimum=0.0)

    def usd(self, role: Role, processed: int, emitted: int, cached: int = 0) -> float:
        """The price of ``processed`` positions, ``emitted`` tokens and ``cached`` positions read from the cache."""
        small = role is Role.SMALL
        price_in = self.small_input if small else self.large_input
        price_out = self.small_output if small else self.large_output
        price_cached = self.small_cached_input if small else self.large_cached_input
        if price_cached is None:
            price_cached = price_in
        return (processed * price_in + emitted * price_out + cached * price_cached) / 1e6


@dataclass(frozen=True)
class Cost:
    """What one completion (or a whole call, when summed) cost. ``to_dict()`` is the API's cost dict."""

    prompt_tokens: int
    completion_tokens: int
    small_tokens: int
    large_tokens: int
    switches: int
    small_processed_tokens: int
    large_processed_tokens: int
    flops: int
    wall_time_s: float
    small_params: int
    large_params: int
    cost_usd: float | None = None
    recomputed_tokens: int = 0
    """Positions fed again after the engine evicted this sequence's cache to make room for others (both models):
    load, not the request's own work, so not in the processed tokens, ``flops`` or ``cost_usd``."""
    small_cached_tokens: int = 0
    large_cached_tokens: int = 0
    """Prompt positions each model took from its prefix cache instead of computing: not processed tokens, not in
    ``flops``; priced by ``Pricing.*_cached_input``."""
    extra: dict[str, int | float] = field(default_factory=dict)
    """Policy-specific counters, summed over a call."""

    @property
    def large_fraction(self) -> float:
        return self.large_tokens / self.completion_tokens if self.completion_tokens else 0.0

    @property
    def parameter_ratio(self) -> float:
        return parameter_ratio(self.large_fraction, self.small_params, self.large_params)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "small_tokens": self.small_tokens,
            "large_tokens": self.large_tokens,
            "large_fraction": self.large_fraction,
            "switches": self.switches,
            "small_processed_tokens": self.small_processed_tokens,
            "large_processed_tokens": self.large_processed_tokens,
            "flops": self.flops,
            "recomputed_tokens": self.recomputed_tokens,
            "small_cached_tokens": self.small_cached_tokens,
            "large_cached_tokens": self.large_cached_tokens,
            "parameter_ratio": self.parameter_ratio,
            "wall_time_s": self.wall_time_s,
        }
        if self.cost_usd is not None:
            out["cost_usd"] = self.cost_usd
        out.update(self.extra)
        if self.extra.get("drafted_tokens"):
            out["acceptance_rate"] = self.extra.get("accepted_tokens", 0) / self.extra["drafted_tokens"]
        return out

    @staticmethod
    def from_dict(cost: dict[str, Any], *, small_params: int, large_params: int) -> Cost:
        """Inverse of :meth:`to_dict` (the derived keys are recomputed, policy counters kept)."""
        derived = {"total_tokens", "large_fraction", "parameter_ratio", "acceptance_rate"}
        names = {f.name for f in fields(Cost)} - {"small_params", "large_params", "extra"}
        return Cost(
            **{k: cost[k] for k in names if k in cost},
            small_params=small_params,
            large_params=large_params,
            extra={k: v for k, v in cost.items() if k not in names | derived},
        )

    @staticmethod
    def total(costs: Iterable[Cost], *, wall_time_s: float) -> Cost:
        """Sum of completions' costs for one call that took ``wall_time_s`` (not a sum of times)."""
        items = list(costs)
        if not items:
            raise ValueError("cannot sum an empty list of costs")
        extra: dict[str, int | float] = {}
        for item in items:
            for key, value in item.extra.items():
                extra[key] = extra.get(key, 0) + value
        usd = [c.cost_usd for c in items]
        return Cost(
            prompt_tokens=sum(c.prompt_tokens for c in items),
            completion_tokens=sum(c.completion_tokens for c in items),
            small_tokens=sum(c.small_tokens for c in items),
            large_tokens=sum(c.large_tokens for c in items),
            switches=sum(c.switches for c in items),
            small_processed_tokens=sum(c.small_processed_tokens for c in items),
            large_processed_tokens=sum(c.large_processed_tokens for c in items),
            flops=sum(c.flops for c in items),
            recomputed_tokens=sum(c.recomputed_tokens for c in items),
            small_cached_tokens=sum(c.small_cached_tokens for c in items),
            large_cached_tokens=sum(c.large_cached_tokens for c in items),
            wall_time_s=wall_time_s,
            small_params=items[0].small_params,
            large_params=items[0].large_params,
            cost_usd=None if any(u is None for u in usd) else sum(u for u in usd if u is not None),
            extra=extra,
        )


class CompletionLedger:
    """Consumes the events of one sequence and reports its cost. Policies never touch it."""

    def __init__(
        self, small: ModelInfo, large: ModelInfo, pricing: Pricing | None = None, counters: Iterable[str] = ()
    ) -> None:
        """``counters``: the policy's counter names (``policy.counters()``), reported even when 0."""
        self._info = {Role.SMALL: small, Role.LARGE: large}
        self._pricing = pricing
        self.prompt_tokens = 0
        """Counted from the events: a request's first event reports its prompt."""
        self._emitted = {Role.SMALL: 0, Role.LARGE: 0}
        self._processed = {Role.SMALL: 0, Role.LARGE: 0}
        self._cached = {Role.SMALL: 0, Role.LARGE: 0}
        self._flops = 0
        self._recomputed = 0
        self._switches = 0
        self._last: Role | None = None
        self._counters: dict[str, int] = dict.fromkeys(counters, 0)

    def record(self, event: TokenEvent) -> None:
        self.prompt_tokens += event.prompt_tokens
        for role, positions in event.cached_tokens:
            self._cached[role] += positions
        for name, count in event.counters:
            self._counters[name] = self._counters.get(name, 0) + count
        self._emitted[event.role] += 1
        if self._last is not None and event.role is not self._last:
            self._switches += 1
        self._last = event.role
        for work in event.work:
            info = self._info[work.role]
            own = work.tokens - work.recomputed  # what the request itself needed
            self._processed[work.role] += own
            self._recomputed += work.recomputed
            self._flops += forward_flops(
                new_tokens=own,
                past_tokens=work.past + work.recomputed,
                non_embedding_params=info.non_embedding_params,
                num_layers=info.num_layers,
                attention_width=info.attention_width,
            )

    def cost(self, wall_time_s: float) -> Cost:
        usd = None
        if self._pricing is not None:
            usd = sum(
                self._pricing.usd(role, self._processed[role], self._emitted[role], self._cached[role]) for role in Role
            )
        return Cost(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self._emitted[Role.SMALL] + self._emitted[Role.LARGE],
            small_tokens=self._emitted[Role.SMALL],
            large_tokens=self._emitted[Role.LARGE],
            switches=self._switches,
            small_processed_tokens=self._processed[Role.SMALL],
            large_processed_tokens=self._processed[Role.LARGE],
            flops=self._flops,
            recomputed_tokens=self._recomputed,
            small_cached_tokens=self._cached[Role.SMALL],
            large_cached_tokens=self._cached[Role.LARGE],
            wall_time_s=wall_time_s,
            small_params=self._info[Role.SMALL].params,
            large_params=self._info[Role.LARGE].params,
            cost_usd=usd,
            extra=dict(self._counters),
        )


def cache_hit_bill(cost: dict[str, Any]) -> dict[str, Any]:
    """The bill of an answer a cache returned: every count and price of ``cost`` (the stored answer's bill) at
    zero, ``cache_hit`` set, so that summing bills never counts the stored work twice."""
    out: dict[str, Any] = {
        key: type(value)(0) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        for key, value in cost.items()
    }
    out["cache_hit"] = True
    return out
