"""Input processing: a caller's requests become the scheduler's sequences (checked, encoded, fitted to the context
and the KV budget, each with its decoder, sample stream, detokenizer and grammar), before anything is queued."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from ead_llm.core.grammar import GrammarCompiler
from ead_llm.core.kv_cache import SequenceKV
from ead_llm.core.loading import ModelPair
from ead_llm.core.output import OutputProcessor
from ead_llm.core.request import Prompt, PromptTooLongError, Request, sequence_key
from ead_llm.core.sampler import stream_key
from ead_llm.core.scheduler import Call
from ead_llm.core.scheduler import Sequence as Seq
from ead_llm.core.types import Role


def check_requests(requests: Sequence[Request]) -> None:
    """Refuse anything but a list of :class:`Request` objects."""
    if isinstance(requests, (str, Request)):
        raise ValueError("requests must be a list of Request objects")
    for request in requests:
        if not isinstance(request, Request):
            raise ValueError(f"requests must be Request objects, got {request!r}")


def warn_unknown_characters(tokenizer: Any, prompt: str) -> None:
    """Warn that ``prompt`` has characters the vocabulary lacks (each reads as the unknown token), naming
    them, and the vocabulary itself when it is small (the embedded pair's 20 tokens)."""
    unk = tokenizer.unk_token_id
    missing = sorted({c for c in prompt if unk in tokenizer.encode(c, add_special_tokens=False)})
    vocab = tokenizer.get_vocab()
    known = ""
    if len(vocab) <= 64:
        chars = sorted(t for t in vocab if len(t) == 1)
        known = (
            f"; this vocabulary has only {''.join(chars)!r} (the embedded pair's prompts look like '4821+3907-1568\\n')"
        )
    warnings.warn(
        f"prompt characters outside the vocabulary, read as {tokenizer.unk_token!r}: {missing}{known}",
        UserWarning,
        stacklevel=4,
    )


class InputProcessor:
    """Encodes prompts and builds sequences for one pair (its tokenizer, vocabulary and context)."""

    def __init__(self, pair: ModelPair, max_positions: int | None) -> None:
        self.pair = pair
        self.tokenizer = pair.tokenizer
        self.max_positions = max_positions
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar machinery (built on the first constrained request)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.pair.vocab_size, self.pair.eos_token_ids)
        return self._grammars

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (special tokens as the tokenizer adds them; BOS for an empty prompt)."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
            unk = self.tokenizer.unk_token_id
            if unk is not None and unk in ids:
                warn_unknown_characters(self.tokenizer, prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.pair.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.pair.vocab_size - 1})")
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise ValueError("prompt must not be empty: this tokenizer has no BOS token to start from")
            ids = [int(bos)]
        return ids

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids a request decodes from: its encoded prompt, left-truncated to fit the context
        when the request asks for it, else refused when it leaves no room for a new token."""
        ids = self.encode(request.prompt)
        limit = self.max_positions
        if limit is None or len(ids) < limit:
            return ids
        if request.sampling.prompt_truncation == "error":
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the models accept at most {limit} positions in all: "
                "shorten the prompt, or pass prompt_truncation='left' to drop its oldest tokens"
            )
        keep = max(1, limit - request.sampling.max_tokens)
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[0] == bos and keep > 1:
            return [ids[0], *ids[len(ids) - keep + 1 :]]
        return ids[len(ids) - keep :]

    def sequence(self, call: Call, index: int, request: Request, budget: int | None, block_size: int) -> Seq:
        """Request ``index`` of ``call`` as a sequence, refused when it could outgrow the KV ``budget``
        (positions per model, in blocks of ``block_size``)."""
        ids = self.prompt_ids(request)
        max_length = len(ids) + request.sampling.max_tokens
        if self.max_positions is not None:
            max_length = min(max_length, self.max_positions)
        if budget is not None and -(-max_length // block_size) * block_size > budget:
            raise ValueError(
                f"a request needs up to {max_length} KV positions (prompt {len(ids)} + max_tokens "
                f"{request.sampling.max_tokens}, in blocks of {block_size}) but kv_budget_tokens is "
                f"{budget}: lower max_tokens or raise the budget"
            )
        params = request.policy.sampling(request.sampling)
        stream = request.sample_index or 0  # the request's own stream, never its place in the call
        decoder = request.policy.build_decoder(sequence_key(ids, stream), call.shared)
        text_here = bool(params.stop) or decoder.forks
        return Seq(
            call=call,
            index=index,
            tokens=ids,
            prompt_len=len(ids),
            params=params,
            decoder=decoder,
            key=stream_key(params.seed, stream),
            kv={role: SequenceKV() for role in Role},
            max_length=max_length,
            eos=self.pair.eos_token_ids,
            output=OutputProcessor(self.tokenizer, ids, params.stop) if text_here else None,
            grammar=None if params.constraint is None else self.grammars.start(params.constraint, len(ids)),
        )
