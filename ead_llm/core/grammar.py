"""Grammar-constrained decoding: what a request's tokens must obey, and the token masks that enforce it.

A :class:`Constraint` (a JSON schema, any JSON object, a regular expression or a Lark grammar) rides
on a request's sampling settings. The engine gives each constrained sequence a :class:`SequenceGrammar`,
an llguidance matcher that follows the sequence's tokens: it accepts each emitted or drafted token,
rolls back what a verification or a preemption drops, and is copied when EAGER branches. Before a
row is sampled (whichever model writes it) its logits outside the grammar's next-token set are set
to ``-inf``; a speculative round's drafts are drawn under those masks and verified under the same
masks (kept per position), so greedy speculative decoding under a constraint equals greedy
``LargeOnly`` under it.

Entropy is taken after the mask: where the grammar leaves one token (a brace, a key's quotes) the
entropy is 0 and EAD stays on the small model; where it leaves a choice, the entropy is the model's
uncertainty among the allowed tokens. (Measured in ``benchmarks/constrained.py``.)

llguidance (vLLM's and llama.cpp's engine) is used rather than xgrammar, measured side by side in
``benchmarks/grammar_engines.py``: xgrammar fills a mask faster (2-3 against 8-16 us per sequence at
batch 16), but both are small beside applying the mask to the logits and beside the step; llguidance
compiles a schema 6-47x faster (0.8-0.9 ms against 4.8-44 ms) and adds 8 MB with no dependencies,
where xgrammar adds 1,057 MB (triton, tvm-ffi). The mask is applied here by a byte lookup (0 or
``-inf`` per bit) and one add: 1.1 ms for 16 rows of 151,936 ids, xgrammar's CPU kernel 7.9 ms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from ead_llm.core.transfer import upload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ead_llm.core.types import DraftRound

ConstraintKind = Literal["json_schema", "json_object", "regex", "lark"]
_KINDS = ("json_schema", "json_object", "regex", "lark")


class ResponseFormatError(ValueError):
    """A ``response_format`` of a shape no constraint stands for (an unknown type, a json_schema without one)."""


class ConstraintViolation(RuntimeError):
    """A token outside the grammar reached a constrained sequence (a bug: masks should prevent it)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "constrained decoding needs llguidance, a dependency of ead-llm: pip install 'llguidance>=1.2'"
        ) from None
    return llguidance


def schema_of(value: Any) -> dict[str, Any]:
    """A JSON schema dict from a dict, a JSON string, a pydantic model class or a TypedDict."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            loaded = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema must be a JSON object, a dict or a pydantic model: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError("json_schema must be a JSON object")
        return loaded
    if isinstance(value, type):
        from pydantic import BaseModel, TypeAdapter

        if issubclass(value, BaseModel):
            return value.model_json_schema()
        try:
            return TypeAdapter(value).json_schema()
        except Exception as exc:
            raise ValueError(f"cannot make a JSON schema of {value!r}: {exc}") from None
    raise ValueError(f"json_schema must be a dict, a JSON string, a pydantic model or a TypedDict, got {value!r}")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists properties and
    does not set it (recursively, through ``$defs``, items, anyOf and the like)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: closed(value) if key not in ("const", "enum", "default", "examples") else value
        for key, value in schema.items()
    }
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class JsonBounds:
    """Length bounds added to a JSON schema where it sets none, so that a weak model ends a structured answer
    instead of writing one number, string or list until ``max_tokens`` (``11.1111...``). A schema's own
    ``maxLength``/``minimum``/``maximum``/``multipleOf``/``maxItems``/``maxProperties`` always win; pass
    ``json_bounds=None`` (or ``Constraint.json_schema(..., bounds=None)``) to lift them all. A map (an object
    that lists no properties, such as ``dict[str, Any]``) gets bounded keys and a bounded number of entries,
    and a value the schema leaves open (``Any``, ``{}``) is any JSON within these same bounds. Whitespace
    between JSON tokens is never allowed (compact JSON), so it cannot run on either."""

    max_string_length: int = 256
    """Most characters of a string without ``maxLength``."""
    max_integer_digits: int = 15
    """Integers without ``minimum``/``maximum`` lie within +-(10**digits - 1)."""
    max_fraction_digits: int = 6
    """Numbers without ``multipleOf`` take at most this many digits after the point (and the integer bound)."""
    max_items: int = 64
    """Most items of an array without ``maxItems``."""
    max_properties: int = 32
    """Most entries of a map (an object listing no properties) without ``maxProperties``."""
    max_key_length: int = 64
    """Most characters of a map's key."""

    def __post_init__(self) -> None:
        for name in (
            "max_string_length",
            "max_integer_digits",
            "max_fraction_digits",
            "max_items",
            "max_properties",
            "max_key_length",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"JsonBounds.{name} must be a positive integer, got {value!r}")

    def apply(self, schema: Any) -> Any:
        """``schema`` with these bounds where it has none (recursively through every sub-schema)."""
        if schema is True or schema == {}:
            schema = {"$ref": _ANY_REF}
        out = self._bounded(schema)
        if isinstance(out, dict) and _ANY_REF in json.dumps(out):  # open values: any JSON within the bounds
            out = {**out, "$defs": {**out.get("$defs", {}), _ANY: self._any()}}
        return out

    def _any(self) -> dict[str, Any]:
        """Any JSON value within these bounds (recursive through ``$ref``)."""
        options = [{"type": kind} for kind in ("string", "integer", "number", "boolean", "null", "array", "object")]
        return {"anyOf": [self._bounded(option) for option in options]}

    def _open(self, value: Any) -> Any:
        """A sub-schema that allows any value, as the bounded any; anything else bounded."""
        return {"$ref": _ANY_REF} if value is True or value == {} else self._bounded(value)

    def _bounded(self, schema: Any) -> Any:
        if not isinstance(schema, dict):
            return schema
        out = dict(schema)
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: self._open(sub) for name, sub in out[key].items()}
        for key in _SCHEMA_ONE:
            if isinstance(out.get(key), dict):
                out[key] = self._open(out[key])
            elif isinstance(out.get(key), list):
                out[key] = [self._open(sub) for sub in out[key]]
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [self._open(sub) for sub in out[key]]
        if "enum" in out or "const" in out:
            return out
        given = out.get("type")
        kinds = set(given) if isinstance(given, list) else {given}
        if "string" in kinds and "maxLength" not in out and "format" not in out:
            out["maxLength"] = max(self.max_string_length, out.get("minLength", 0))
        if kinds & {"integer", "number"}:
            limit = 10**self.max_integer_digits - 1
            if not {"minimum", "exclusiveMinimum"} & set(out):
                out["minimum"] = -limit
            if not {"maximum", "exclusiveMaximum"} & set(out):
                out["maximum"] = limit
            if "number" in kinds and "integer" not in kinds and "multipleOf" not in out:
                out["multipleOf"] = 10.0**-self.max_fraction_digits
        if "array" in kinds and "maxItems" not in out:
            out["maxItems"] = max(self.max_items, out.get("minItems", 0))
        if "array" in kinds and "items" not in out and "prefixItems" not in out:
            out["items"] = {"$ref": _ANY_REF}
        if "object" in kinds and not {"properties", "patternProperties"} & set(out):
            values = out.get("additionalProperties", True)
            if values is not False:  # a map: keys and entries bounded, values as the schema says
                out["patternProperties"] = {f"^.{{0,{self.max_key_length}}}$": self._open(values)}
                out["additionalProperties"] = False
                out.setdefault("maxProperties", max(self.max_properties, out.get("minProperties", 0)))
        return out


_ANY = "ead_llm_any"
_ANY_REF = f"#/$defs/{_ANY}"
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
DEFAULT_BOUNDS = JsonBounds()


@dataclass(frozen=True)
class Constraint:
    """What every generated token must obey (checked when built: a bad grammar raises ``ValueError``).

    Build one with :meth:`json_schema`, :meth:`json_object`, :meth:`regex` or :meth:`lark`.
    """

    kind: ConstraintKind
    spec: str = ""
    """The schema as canonical JSON, the pattern, or the Lark grammar ('' for ``json_object``)."""
    grammar: str = field(default="", compare=False, repr=False)
    """llguidance's grammar, derived."""
    source: str = field(default="", compare=False, repr=False)
    """A JSON schema as given (before ``strict`` closed it and bounds were added): what a prompt shows."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"constraint kind must be one of {_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"constraint spec must be a string, got {self.spec!r}")
        matcher = _llguidance().LLMatcher
        if self.kind in ("json_schema", "json_object"):
            schema = json.loads(self.spec) if self.kind == "json_schema" else {"type": "object"}
            try:
                grammar = matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            except ValueError as exc:
                raise ValueError(f"invalid JSON schema: {exc}") from None
        elif self.kind == "regex":
            grammar = matcher.grammar_from_regex(self.spec)
        else:
            grammar = matcher.grammar_from_lark(self.spec)
        error = matcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {self.kind.replace('_', ' ')} constraint: {error.strip()}")
        object.__setattr__(self, "grammar", grammar)

    @classmethod
    def json_schema(cls, schema: Any, *, strict: bool = True, bounds: JsonBounds | None = DEFAULT_BOUNDS) -> Constraint:
        """Output is one JSON value valid under ``schema`` (a dict, JSON text, pydantic model or TypedDict).
        ``strict`` (as OpenAI's strict mode): objects that do not say otherwise take no properties beyond
        those listed, so the model cannot wander into keys nobody asked for. ``bounds``: the length bounds
        added where the schema sets none (:class:`JsonBounds`; None for none)."""
        given = schema = schema_of(schema)
        if strict:
            schema = closed(schema)
        if bounds is not None:
            schema = bounds.apply(schema)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), source=json.dumps(given))

    @classmethod
    def json_object(cls) -> Constraint:
        """Output is one JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output matches ``pattern`` in full."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Output is derived from the Lark grammar (llguidance's dialect: ``start: ...``)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"grammar must be a non-empty Lark grammar, got {grammar!r}")
        return cls("lark", grammar)

    @classmethod
    def response_format(cls, value: Any, *, bounds: JsonBounds | None = DEFAULT_BOUNDS) -> Constraint | None:
        """The constraint of OpenAI's ``response_format``: ``{"type": "json_object"}``, ``{"type": "json_schema",
        "json_schema": {"schema": ..., "strict": ...}}`` (or lm15's flat shape with ``schema`` beside ``type``;
        ``strict`` unless it says otherwise), or a pydantic class; None for ``text``. A shape it cannot read is a
        :class:`ResponseFormatError`; an invalid schema a ``ValueError``."""
        if value is None:
            return None
        if isinstance(value, type):
            return cls.json_schema(value, bounds=bounds)
        if not isinstance(value, dict):
            raise ResponseFormatError(f"ead-llm cannot honour response_format {value!r}")
        kind = value.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = value.get("json_schema", value)
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ResponseFormatError("response_format json_schema needs a 'schema' object")
            return cls.json_schema(schema, strict=bool(spec.get("strict", True)), bounds=bounds)
        raise ResponseFormatError(f"ead-llm cannot honour response_format of type {kind!r}")

    def lark_rule(self) -> str:
        """This constraint as the body of a rule in a Lark grammar (to combine it with others)."""
        if self.kind in ("json_schema", "json_object"):
            schema = json.loads(self.spec) if self.kind == "json_schema" else {"type": "object"}
            return f"%json {json.dumps({**schema, 'x-guidance': {'whitespace_flexible': False}})}"
        if self.kind == "regex":
            return "/" + self.spec.replace("/", "\\/") + "/"
        raise ValueError("a Lark grammar cannot be nested in another constraint")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.spec}


def mask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask."""
    return (vocab_size + 31) // 32


_BIAS: dict[torch.device, torch.Tensor] = {}


def _byte_bias(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` float32: for each byte value, 0 where its bit is set and ``-inf`` where not."""
    table = _BIAS.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        table = _BIAS[device] = torch.where(bits == 1, 0.0, float("-inf")).to(device)
    return table


def mask_bias(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[N, W]`` int32 bitmask (bit ``i % 32`` of word ``i // 32`` set: token ``i`` allowed) -> ``[N, V]``
    float32, 0 for allowed tokens and ``-inf`` for the rest (a byte lookup: no per-bit arithmetic)."""
    rows = bitmask.shape[0]
    data = bitmask.to(device, non_blocking=True).contiguous().view(torch.uint8).reshape(-1).int()
    return _byte_bias(device).index_select(0, data).reshape(rows, -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits`` ``[N, V]`` to ``-inf`` where ``bitmask`` ``[N, W]`` forbids a token (in place; allowed
    logits are unchanged bit for bit). Little-endian byte order, as llguidance and xgrammar write."""
    logits.add_(mask_bias(bitmask, logits.shape[-1], logits.device))


def mask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Rows ``rows`` of ``logits`` ``[N, ..., V]`` lose the tokens ``bitmask`` ``[len(rows), ..., W]`` forbids, in
    place (a pass's constrained rows; a verification's rounds, position by position)."""
    vocab, words = logits.shape[-1], bitmask.shape[-1]
    if rows == list(range(logits.shape[0])):
        apply_bitmask(logits.view(-1, vocab), bitmask.reshape(-1, words))
        return
    index = upload(rows, torch.int64, logits.device)
    part = logits.index_select(0, index)
    apply_bitmask(part.view(-1, vocab), bitmask.reshape(-1, words))
    logits.index_copy_(0, index, part)


def round_masks(
    grammars: list[SequenceGrammar], rounds: list[DraftRound], now: torch.Tensor, width: int
) -> tuple[torch.Tensor, list[int]]:
    """``[R, width, W]`` masks of verification rounds: at each draft, the mask it was drawn under (kept by its
    grammar), then ``now`` ``[R, W]`` (where each grammar stands); and the rounds whose kept masks are missing
    (they cannot be verified; their rows allow everything and must not be read)."""
    bitmask = torch.full((len(rounds), width, now.shape[1]), -1, dtype=torch.int32)
    missing = []
    for j, (grammar, round_) in enumerate(zip(grammars, rounds, strict=True)):
        drafts = len(round_.tokens)
        kept = [grammar.mask_at(round_.first_position + d) for d in range(drafts)]
        if any(mask is None for mask in kept):
            missing.append(j)
            continue
        if kept:
            bitmask[j, :drafts] = torch.stack(kept)  # type: ignore[arg-type]
        bitmask[j, drafts:] = now[j]
    return bitmask, missing


SUPPORTED_TOKENIZERS = (
    "constrained decoding needs a fast Hugging Face tokenizer whose decoder llguidance reads (byte-level BPE, "
    "as GPT-2, Llama 3, Qwen and SmolLM use, or SentencePiece with byte fallback), or one whose tokens' texts "
    "simply join (character- or word-level without spaces)"
)
_PROBE = "Constrained 12+35=47; café, naïve, 数学 and\nnew lines."


def grammar_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]) -> Any:
    """llguidance's view of ``tokenizer``: read from its own JSON when llguidance knows its decoder, else built
    from each token's bytes when decoding is plain concatenation of the tokens' texts (a character-level
    tokenizer such as the embedded pair's); else a ``ValueError`` that says which tokenizers are supported."""
    llguidance = _llguidance()
    from llguidance.hf import from_tokenizer

    eos = sorted(eos_token_ids) or None
    try:
        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)  # type: ignore[arg-type]
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    special = set(getattr(tokenizer, "all_special_ids", ()))
    texts = [str(tokenizer.decode([i], skip_special_tokens=False)) for i in range(vocab_size)]
    probe = [i for i in tokenizer.encode(_PROBE, add_special_tokens=False) if i not in special]
    known = [i for i in probe if i != tokenizer.unk_token_id]
    if not known or tokenizer.decode(known) != "".join(texts[i] for i in known):
        raise ValueError(f"{SUPPORTED_TOKENIZERS}; this tokenizer is neither ({reason})")

    unknown = tokenizer.unk_token_id

    class Joined:
        """A tokenizer whose text is its tokens' texts joined: each token's bytes are its text's UTF-8."""

        eos_token_id = eos[0] if eos else None
        bos_token_id = tokenizer.bos_token_id
        special_token_ids = sorted(special)

        def __init__(self) -> None:
            self.tokens = [text.encode("utf-8") for text in texts]

        def __call__(self, text: str) -> list[int]:
            # a character the vocabulary lacks spells nothing (never the unknown token, which is not that text)
            return [i for i in tokenizer.encode(text, add_special_tokens=False) if i != unknown]

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Joined()), n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """One tokenizer's grammar machinery (built once per engine, on first use): the token trie, and
    a thread pool that computes a batch's masks in parallel."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        llguidance = _llguidance()
        self.words = mask_words(vocab_size)
        self.eos = eos_token_ids
        self.tokenizer = grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self._executor = llguidance.LLExecutor()
        self._matcher = llguidance.LLMatcher

    def start(self, constraint: Constraint, length: int) -> SequenceGrammar:
        """A matcher for a sequence whose first ``length`` tokens (its prompt) are not constrained."""
        matcher = self._matcher(self.tokenizer, constraint.grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"the {constraint.kind.replace('_', ' ')} constraint does not compile: {matcher.get_error()}"
            )
        grammar = SequenceGrammar(matcher, length, self.eos)
        _, failed = self.masks([grammar])  # the first mask now (kept for the first step): an error is the request's
        if failed:
            raise ValueError(f"the {constraint.kind.replace('_', ' ')} constraint cannot start: {failed[0]}")
        return grammar

    def constrain(self, logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> dict[int, Exception]:
        """Rows of ``logits`` ``[N, V]`` with a grammar lose the tokens it forbids (in place), before anything
        reads them (sampling, entropy, drafts); the rows whose matcher failed, with the error (the caller fails
        them)."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return {}
        bitmask, failed = self.masks([grammars[i] for i in rows])  # type: ignore[misc]
        mask_rows(logits, rows, bitmask)
        return {rows[j]: exc for j, exc in failed.items()}

    def constrain_rounds(
        self, target: torch.Tensor, grammars: list[SequenceGrammar | None], rounds: list[DraftRound]
    ) -> dict[int, Exception]:
        """The large model's logits ``target`` ``[R, G+1, V]`` of rounds with a grammar, in place: at each draft
        under the mask it was drawn under, after the drafts under the grammar's mask where it stands now. The
        rounds that cannot be judged so (a failed matcher, a kept mask missing), with the error."""
        rows = [j for j, g in enumerate(grammars) if g is not None]
        if not rows:
            return {}
        constrained = [g for g in grammars if g is not None]
        now, failed = self.masks(constrained)
        bitmask, missing = round_masks(constrained, [rounds[j] for j in rows], now, target.shape[1])
        mask_rows(target, rows, bitmask)
        errors: dict[int, Exception] = {rows[j]: exc for j, exc in failed.items()}
        for j in missing:
            errors.setdefault(
                rows[j], RuntimeError(f"no grammar mask kept for a draft after {rounds[rows[j]].first_position}")
            )
        return errors

    def masks(self, grammars: list[SequenceGrammar]) -> tuple[torch.Tensor, dict[int, Exception]]:
        """``[N, W]`` int32 bitmasks of each grammar's next token (kept by each grammar for its position), and the
        rows whose matcher failed, with the error (their mask allows every token; the caller fails them)."""
        out = torch.full((len(grammars), self.words), -1, dtype=torch.int32)
        need = [i for i, g in enumerate(grammars) if g.length not in g.cached]
        for i, g in enumerate(grammars):
            if g.length in g.cached:
                out[i] = g.cached[g.length]
        failures: dict[int, Exception] = {}
        try:
            if len(need) == 1:
                grammars[need[0]].matcher.unsafe_compute_mask_ptr(out[need[0]].data_ptr(), self.words * 4)
            elif need:
                self._executor.unsafe_compute_mask_ptr(
                    [(grammars[i].matcher, i) for i in need], out.data_ptr(), self.words * 4, len(grammars)
                )
        except Exception:  # one matcher broke the batch: compute each alone to find which
            for i in need:
                try:
                    grammars[i].matcher.unsafe_compute_mask_ptr(out[i].data_ptr(), self.words * 4)
                except Exception as exc:
                    failures[i] = exc
        for i in need:
            if i not in failures:
                try:
                    grammars[i].check()
                    if not bool(out[i].any()):
                        raise ConstraintViolation(
                            "no token of this vocabulary can continue the constraint here: the vocabulary cannot "
                            "spell what the grammar needs (e.g. JSON with a vocabulary without '{')"
                        )
                except ConstraintViolation as exc:
                    failures[i] = exc
            if i in failures:
                out[i] = -1
            else:
                grammars[i].cached[grammars[i].length] = out[i].clone()
        return out, failures


class SequenceGrammar:
    """The grammar state of one sequence: it follows the sequence's tokens (accept, roll back, copy)
    and keeps the masks of its positions not yet committed (a round's drafts, for their verification)."""

    def __init__(self, matcher: Any, length: int, eos: frozenset[int]) -> None:
        self.matcher = matcher
        self.length = length
        """Tokens of the sequence the matcher has seen (the prompt counts, unconstrained)."""
        self.eos = eos
        self.eos_at: int | None = None
        """Position of an end-of-text token (kept out of the matcher: nothing follows it, and a stopped
        matcher cannot roll it back)."""
        self.cached: dict[int, torch.Tensor] = {}
        """Bitmask ``[W]`` per position, for positions not yet committed."""

    def check(self) -> None:
        if self.matcher.is_error():
            error = self.matcher.get_error().splitlines()[0]
            if error.startswith("NoExtension"):
                raise ConstraintViolation(
                    "no token of this vocabulary can continue the constraint here: the vocabulary cannot spell what "
                    f"the grammar needs (e.g. JSON with a vocabulary without '{{') [llguidance: {error}]"
                )
            raise ConstraintViolation(f"the grammar matcher failed: {error}")

    def accept(self, token: int, *, commit: bool) -> None:
        """``token`` is appended (``commit``: emitted for good, not a draft)."""
        if self.eos_at is not None:
            raise ConstraintViolation(f"token {token} follows the end of the text at position {self.eos_at}")
        if token in self.eos:
            if not self.matcher.is_accepting():
                raise ConstraintViolation(f"end of text at position {self.length}, before the grammar is complete")
            self.eos_at = self.length
        elif not self.matcher.consume_token(token):
            raise ConstraintViolation(
                f"token {token} at position {self.length} is outside the constraint: {self.matcher.get_error()}"
            )
        self.length += 1
        if commit:
            self.cached = {p: m for p, m in self.cached.items() if p >= self.length}

    def rollback_to(self, keep: int) -> None:
        """The sequence keeps its first ``keep`` tokens."""
        drop = self.length - keep
        if drop <= 0:
            return
        if self.eos_at is not None and self.eos_at >= keep:
            self.eos_at, drop = None, drop - 1
        if drop and not self.matcher.rollback(drop):
            raise ConstraintViolation(f"the grammar matcher cannot roll back {drop} tokens: {self.matcher.get_error()}")
        self.length = keep
        self.cached = {p: m for p, m in self.cached.items() if p <= keep}

    def mask_at(self, position: int) -> torch.Tensor | None:
        """The kept bitmask of ``position`` (None when not kept)."""
        return self.cached.get(position)

    def fork(self) -> SequenceGrammar:
        """An independent copy (a branched path continues from here)."""
        copy = SequenceGrammar(self.matcher.deep_copy(), self.length, self.eos)
        copy.eos_at, copy.cached = self.eos_at, dict(self.cached)
        return copy
