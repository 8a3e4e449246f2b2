"""The rejection sampler: a batch of speculative rounds judged at once, with no per-row Python.

For round ``r`` the small model drafted ``num_drafts[r]`` tokens (padded to ``G``); the large model
scored the position before each draft and one more. Per position ``i``:

- greedy rows (temperature 0): the draft stands while it is the large model's argmax;
- sampled rows: it stands with probability ``min(1, p(x) / q(x))``, ``p``/``q`` the two models'
  sampling distributions (:func:`ead_llm.core.ops.filtered_probs`, the sampler's own filter, ties at
  each cut kept) (Leviathan et al., arXiv 2211.17192); a draft with ``q(x) = 0`` never stands;
- oracle rows: it stands while the two models' argmaxes agree (whatever was drafted);
- EASD rows: a draft that would stand is rejected when both models' entropies (bits, raw logits)
  exceed ``entropy_threshold`` and their top-``top_n`` sets (ties at the cut kept) share more than
  ``overlap_threshold`` of ``top_n`` tokens (arXiv 2512.23765).

The round's last token is drawn at the first rejected position from ``norm(max(0, p - q))``
(speculative), from ``p`` without the draft (EASD's rejection; greedy: the best other token), or
from ``p`` (oracle; the bonus after a clean sweep); an oracle round whose drafts all stand ends
without one. Uniforms come from :func:`ead_llm.core.sampler.uniforms`, keyed by position.

Siblings (greedy rounds, :attr:`ead_llm.core.types.Read.siblings`): when a draft is rejected by the greedy rule and
the sibling read at its position is the large model's own token there (the round's last token), the large model's
argmax after that sibling, read in the same pass, closes the round too (``extra``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from ead_llm.core.ops import best, entropy_and_best, filtered_probs, sorts_whole_rows
from ead_llm.core.sampler import LANE_ACCEPT, LANE_RESIDUAL, inverse_cdf, row_blocks, uniforms
from ead_llm.core.transfer import upload
from ead_llm.core.types import DraftRound, RoundVerdict

if TYPE_CHECKING:
    from ead_llm.core.request import SamplingParams


@dataclass(frozen=True)
class VerifyBatch:
    """The inputs of one batch of rounds (all tensors on the logits' device)."""

    draft_tokens: torch.Tensor
    """[R, G] int64 (padding past ``num_drafts`` is ignored)."""
    num_drafts: torch.Tensor
    """[R] int64."""
    draft_logits: torch.Tensor
    """[R, G, V] raw logits each draft was drawn from."""
    draft_entropy: torch.Tensor
    """[R, G] float32 bits of ``draft_logits`` (computed when the drafts were sampled)."""
    target_logits: torch.Tensor
    """[R, G + 1, V] the large model's raw logits at the drafts' positions and one more."""
    temperature: torch.Tensor
    """[R] float32 (0: greedy)."""
    top_k: torch.Tensor
    """[R] int64."""
    top_p: torch.Tensor
    """[R] float32."""
    keys: torch.Tensor
    """[R] int64 random keys."""
    positions: torch.Tensor
    """[R] int64 position of each round's first draft."""
    entropy_threshold: torch.Tensor
    """[R] float32 (inf: no entropy-aware rejection)."""
    top_n: torch.Tensor
    """[R] int64."""
    overlap_threshold: torch.Tensor
    """[R] float32."""
    oracle: torch.Tensor
    """[R] bool."""
    sibling_tokens: torch.Tensor | None = None
    """[R, G] int64 the token read beside each draft (padding past ``sibling_count`` is ignored)."""
    sibling_count: torch.Tensor | None = None
    """[R] int64 siblings read for each round (0: none)."""
    sibling_logits: torch.Tensor | None = None
    """[R, G, V] the large model's raw logits after each sibling."""
    max_top_k: int = 0
    """Largest top-k of a sampled row."""
    any_top_p: bool = False
    """Whether a sampled row uses top-p."""
    max_top_n: int = 1
    """Largest ``top_n`` of a row that may reject on entropy (1 when none may)."""
    any_sampled: bool = False
    any_entropy_rule: bool = False
    """Whether a round may reject on entropy (one whose threshold is finite)."""
    any_oracle: bool = True
    """Whether a round is an oracle's (judged by the models' best tokens alone)."""

    def rounds(self, block: slice) -> VerifyBatch:
        """The rounds ``block`` of this batch (the flags stay the whole batch's: they only widen what is computed)."""
        columns = {f.name: getattr(self, f.name) for f in fields(self)}
        sliced: dict[str, Any] = {k: v[block] for k, v in columns.items() if isinstance(v, torch.Tensor)}
        return replace(self, **sliced)


@dataclass(frozen=True)
class VerifyOutput:
    """The verdict of each round."""

    accepted: torch.Tensor
    """[R] int64 drafts that stand (a prefix)."""
    token: torch.Tensor
    """[R] int64 the round's last token, written by the large model; -1 when the round ends with its drafts."""
    entropy_rejection: torch.Tensor
    """[R] int64: 1 when the round ended on an entropy-aware rejection."""
    target_entropy: torch.Tensor
    """[R, G + 1] float32 bits of the large model's raw logits at each position."""
    extra: torch.Tensor
    """[R] int64 the large model's token after the closing one, read at the sibling that is that token; -1: none."""
    extra_entropy: torch.Tensor
    """[R] float32 bits of the logits ``extra`` was read from (0 where none)."""


def top_n_overlap(a: torch.Tensor, b: torch.Tensor, top_n: torch.Tensor, largest: int) -> torch.Tensor:
    """``|topN(a) ∩ topN(b)| / N`` over the last dimension of ``a``, ``b`` ``[R, G, V]``, with N = ``top_n`` ``[R]``
    (at most ``largest``) -> ``[R, G]``, at most 1. A top-N set keeps ties at its cut (the sampler's rule: the
    sets depend on the values alone) and never a masked (-inf) token."""
    n = min(largest, a.shape[-1])
    rank = (torch.clamp(top_n, max=n) - 1)[:, None, None].expand(-1, a.shape[1], 1)  # [R, G, 1]

    def top_set(x: torch.Tensor) -> torch.Tensor:
        cut = torch.topk(x, n, dim=-1).values.gather(-1, rank)  # [R, G, 1] the N-th largest value
        return (x >= cut) & (x > -torch.inf)

    shared = (top_set(a) & top_set(b)).sum(-1).to(torch.float32)
    return torch.clamp(shared / torch.clamp(top_n, max=n)[:, None].to(torch.float32), max=1.0)


def verify(batch: VerifyBatch) -> VerifyOutput:
    """Judge every round of ``batch`` (see the module docstring), in blocks of rounds whose logits fit the CPU's
    cache (:func:`ead_llm.core.sampler.row_blocks`; a round's verdict depends on the round alone)."""
    rounds, width, vocab = batch.target_logits.shape
    blocks = row_blocks(rounds, width * vocab, batch.target_logits.device)
    if len(blocks) <= 1:
        return _verify(batch)
    verdicts = [_verify(batch.rounds(block)) for block in blocks]
    return VerifyOutput(*(torch.cat([getattr(v, f.name) for v in verdicts]) for f in fields(VerifyOutput)))


def _verify(batch: VerifyBatch) -> VerifyOutput:
    drafts, device = batch.draft_tokens, batch.draft_tokens.device
    gamma = drafts.shape[1]
    vocab = batch.target_logits.shape[-1]
    target_entropy, target_best = entropy_and_best(batch.target_logits)  # [R, G+1] each: one read of the logits
    greedy = (batch.temperature == 0)[:, None]  # [R, 1]
    positions = torch.arange(gamma, device=device)
    valid = positions[None, :] < batch.num_drafts[:, None]  # [R, G]

    stands = drafts == target_best[:, :gamma]  # greedy rule [R, G]
    p = q = None
    if batch.any_sampled:
        temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        p = _probs(batch.target_logits, temperature, batch)  # [R, G+1, V]
        q = _probs(batch.draft_logits, temperature, batch)  # [R, G, V]
        p_x = p[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
        ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), 0.0)  # a draft q cannot draw never stands
        u = uniforms(batch.keys, batch.positions, LANE_ACCEPT, max(gamma, 1))[:, :gamma]
        stands = torch.where(greedy, stands, u < ratio.clamp(max=1.0).double())
    if batch.any_oracle:
        oracle_stands = best(batch.draft_logits) == target_best[:, :gamma]
        stands = torch.where(batch.oracle[:, None], oracle_stands, stands)

    uncertain = torch.zeros_like(stands)
    if batch.any_entropy_rule and gamma:
        threshold = batch.entropy_threshold[:, None]
        asked = stands & (batch.draft_entropy > threshold) & (target_entropy[:, :gamma] > threshold)  # both unsure
        uncertain = asked & _overlapping(batch, asked)
    keep = stands & ~uncertain & valid
    # the first position that does not stand (num_drafts when every draft stands)
    ends = torch.where(keep, gamma, positions[None, :]).amin(dim=1) if gamma else batch.num_drafts
    accepted = torch.minimum(ends, batch.num_drafts)  # [R]
    at = accepted[:, None]
    rejected = accepted < batch.num_drafts
    by_entropy = rejected & (uncertain.gather(1, at.clamp(max=max(gamma - 1, 0))).squeeze(1) if gamma else rejected)
    draft_at = drafts.gather(1, at.clamp(max=max(gamma - 1, 0))).squeeze(1) if gamma else accepted

    # the distribution the last token is drawn from, per round: [R, V]
    greedy_token = target_best.gather(1, at).squeeze(1)
    if batch.any_entropy_rule:  # a round rejected on entropy takes the large model's best but its draft
        target_at = batch.target_logits.gather(1, at[..., None].expand(-1, -1, vocab)).squeeze(1)  # raw logits
        masked = target_at.scatter(1, draft_at[:, None], -torch.inf)
        greedy_token = torch.where(by_entropy, best(masked), greedy_token)
    token = greedy_token
    if p is not None and q is not None:
        p_at = p.gather(1, at[..., None].expand(-1, -1, vocab)).squeeze(1)  # [R, V]
        if gamma:
            q_at = q.gather(1, at.clamp(max=gamma - 1)[..., None].expand(-1, -1, vocab)).squeeze(1)
            residual = torch.clamp(p_at - q_at, min=0.0)
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
            without = p_at.scatter(1, draft_at[:, None], 0.0)
            without = torch.where(without.sum(-1, keepdim=True) > 0, without, p_at)
            plain = rejected & ~by_entropy & ~batch.oracle
            dist = torch.where(plain[:, None], residual, torch.where(by_entropy[:, None], without, p_at))
        else:
            dist = p_at
        u = uniforms(batch.keys, batch.positions + accepted, LANE_RESIDUAL, 1)
        drawn = inverse_cdf(dist, u)[:, 0]
        token = torch.where(greedy[:, 0], greedy_token, drawn)
    # an oracle round whose drafts all stand ends with them: whether the models agree next is not known yet
    no_token = batch.oracle & ~rejected & (batch.num_drafts > 0)
    token = torch.where(no_token, -1, token)
    extra, extra_entropy = _sibling_extra(batch, accepted, rejected & greedy[:, 0] & ~by_entropy & ~batch.oracle, token)
    return VerifyOutput(
        accepted=accepted,
        token=token,
        entropy_rejection=by_entropy.to(torch.int64),
        target_entropy=target_entropy,
        extra=extra,
        extra_entropy=extra_entropy,
    )


def _overlapping(batch: VerifyBatch, asked: torch.Tensor) -> torch.Tensor:
    """Whether each draft position's top-N sets overlap by more than its round's threshold ``[R, G]``, at least at the
    ``asked`` positions (where both models are unsure: the others' answers are not read). Where the data may steer the
    work (not on a device whose rows are sorted whole) and at most half the positions are asked, worked out there only
    (the others False): a top-N over the vocabulary per position (a round of 4 drafts over 49,152 tokens, one thread:
    one asked position cost 0.67-0.95 ms against 1.6-2.1 for all four; every one asked, gathered, 1.3-1.6x those)."""
    drafts, targets = batch.draft_logits, batch.target_logits[:, : asked.shape[1]]
    where = None if sorts_whole_rows(drafts) else asked.nonzero()  # [K, 2]: round, position
    if where is None or 2 * len(where) > asked.numel():
        return top_n_overlap(drafts, targets, batch.top_n, batch.max_top_n) > batch.overlap_threshold[:, None]
    out = torch.zeros_like(asked)
    if len(where):
        r, g = where[:, 0], where[:, 1]
        overlap = top_n_overlap(drafts[r, g][:, None], targets[r, g][:, None], batch.top_n[r], batch.max_top_n)
        out[r, g] = overlap[:, 0] > batch.overlap_threshold[r]
    return out


def _sibling_extra(
    batch: VerifyBatch, accepted: torch.Tensor, judged: torch.Tensor, token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's extra token and its bits ``[R]`` each: where ``judged`` (a greedy rejection at ``accepted``) and
    the sibling read there is the closing ``token``, the large model's argmax after it; else -1 and 0."""
    rounds = accepted.shape[0]
    none = torch.full((rounds,), -1, dtype=torch.long, device=accepted.device)
    zero = torch.zeros(rounds, dtype=torch.float32, device=accepted.device)
    if batch.sibling_logits is None or batch.sibling_tokens is None or batch.sibling_count is None:
        return none, zero
    at = accepted.clamp(max=batch.sibling_tokens.shape[1] - 1)[:, None]  # [R, 1]
    read = judged & (accepted < batch.sibling_count) & (batch.sibling_tokens.gather(1, at).squeeze(1) == token)
    vocab = batch.sibling_logits.shape[-1]
    after = batch.sibling_logits.gather(1, at[..., None].expand(-1, -1, vocab)).squeeze(1)  # [R, V]
    entropy, token = entropy_and_best(after)  # one read of the rows
    return torch.where(read, token, none), torch.where(read, entropy, zero)


def _probs(logits: torch.Tensor, temperature: torch.Tensor, batch: VerifyBatch) -> torch.Tensor:
    """Sampling distributions of ``logits`` ``[R, P, V]`` with each round's settings -> ``[R, P, V]``."""
    rounds, width, vocab = logits.shape
    flat = filtered_probs(
        logits.reshape(rounds * width, vocab),
        temperature.repeat_interleave(width),
        batch.top_k.repeat_interleave(width),
        batch.top_p.repeat_interleave(width),
        max_top_k=batch.max_top_k,
        any_top_p=batch.any_top_p,
    )
    return flat.view(rounds, width, vocab)


def verify_batch(
    params: list[SamplingParams],
    keys: list[int],
    rounds: list[DraftRound],
    target: torch.Tensor,
    gamma: int,
    siblings: tuple[torch.Tensor, list[int]] | None = None,
) -> VerifyBatch:
    """The input of :func:`verify` for ``rounds`` (each sequence's sampling ``params`` and sample-stream ``keys``),
    padded to ``gamma`` drafts, with the large model's logits ``target`` ``[R, G+1, V]`` and, where the pass read
    siblings, the logits after them ``[R, G, V]`` and how many each round had read."""
    vocab, device = target.shape[-1], target.device
    filler = torch.zeros(vocab, device=device)
    draft_logits = (
        torch.stack([torch.stack([*r.logits, *[filler] * (gamma - len(r.tokens))]) for r in rounds])
        if gamma
        else torch.zeros((len(rounds), 0, vocab), device=device)
    )
    sampled = [p for p in params if p.temperature > 0]

    def column(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return upload(values, dtype, device)

    def padded(values: list[tuple[Any, ...]], fill: Any) -> list[list[Any]]:
        return [[*v, *[fill] * (gamma - len(v))] for v in values]

    entropy_rule = [r for r in rounds if r.entropy_threshold != float("inf")]
    return VerifyBatch(
        draft_tokens=column(padded([r.tokens for r in rounds], 0), torch.long).reshape(len(rounds), gamma),
        num_drafts=column([len(r.tokens) for r in rounds], torch.long),
        draft_logits=draft_logits,
        draft_entropy=column(padded([r.entropies for r in rounds], 0.0), torch.float32).reshape(len(rounds), gamma),
        target_logits=target,
        temperature=column([p.temperature for p in params], torch.float32),
        top_k=column([p.top_k for p in params], torch.long),
        top_p=column([p.top_p for p in params], torch.float32),
        keys=column(keys, torch.long),
        positions=column([r.first_position for r in rounds], torch.long),
        entropy_threshold=column([r.entropy_threshold for r in rounds], torch.float32),
        top_n=column([r.top_n for r in rounds], torch.long),
        overlap_threshold=column([r.overlap_threshold for r in rounds], torch.float32),
        oracle=column([r.oracle for r in rounds], torch.bool),
        sibling_tokens=None
        if siblings is None
        else column(padded([r.siblings[:n] for r, n in zip(rounds, siblings[1], strict=True)], 0), torch.long).reshape(
            len(rounds), gamma
        ),
        sibling_count=None if siblings is None else column(siblings[1], torch.long),
        sibling_logits=None if siblings is None else siblings[0],
        max_top_k=max((p.top_k for p in sampled), default=0),
        any_top_p=any(p.top_p < 1.0 for p in sampled),
        max_top_n=max((r.top_n for r in entropy_rule), default=1),
        any_sampled=bool(sampled),
        any_entropy_rule=bool(entropy_rule),
        any_oracle=any(r.oracle for r in rounds),
    )


@dataclass(frozen=True)
class JudgedRounds:
    """Verified rows of one pass, on the device until the pass's one host sync."""

    rows: list[int]
    """The pass's row of each."""
    verdict: VerifyOutput

    def columns(self) -> list[torch.Tensor]:
        v = self.verdict
        return [v.accepted, v.token, v.entropy_rejection, v.target_entropy, v.extra, v.extra_entropy]

    def results(self, host: list[list[float]]) -> list[tuple[int, RoundVerdict]]:
        """Each row's :class:`RoundVerdict`, from :meth:`columns` on the host."""
        accepted, token, rejected, entropy, extra, extra_entropy = host
        width = self.verdict.target_entropy.shape[1]
        return [
            (
                row,
                RoundVerdict(
                    accepted=int(accepted[j]),
                    token=None if token[j] < 0 else int(token[j]),
                    entropy_rejection=bool(rejected[j]),
                    target_entropy=tuple(entropy[j * width : (j + 1) * width]),
                    extra=None if extra[j] < 0 else int(extra[j]),
                    extra_entropy=extra_entropy[j],
                ),
            )
            for j, row in enumerate(self.rows)
        ]
