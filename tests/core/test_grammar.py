"""Grammar-constrained decoding across both models: every output obeys its constraint whichever model
wrote each token; speculative decoding under a constraint equals LargeOnly under it; masks, rollback,
branching and preemption keep the grammar in step with the sequence."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ead_llm import EAD, EAGER, EASD, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.grammar import Constraint, apply_bitmask, mask_words
from ead_llm.core.loading import LoadConfig, ModelPair, load_pair
from ead_llm.core.ops import entropy_bits
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.streams import _full_path
from ead_llm.core.types import FinishReason
from ead_llm.testing.tiny import build_tiny_pair, byte_bpe_tokenizer

JSON_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "score": -1.5e3}',
    '[{"id": 1}, {"id": 22, "note": null}] The quick brown fox. 12 + 35 = 47.',
    'café, naïve, 数学 and 🙂: {"k": "v"}',
] * 6

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Person:", "Give JSON", "x", '{"a": 1}']


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """A random Llama pair on a byte-level BPE vocabulary whose merges span JSON punctuation ('{"', '":')."""
    tokenizer = byte_bpe_tokenizer(JSON_CORPUS, vocab_size=420)
    small, large = build_tiny_pair(tmp_path_factory.mktemp("bpe"), family="llama", tokenizer=tokenizer, seed=11)
    return load_pair(LoadConfig(small=str(small), large=str(large), device="cpu"))


@pytest.fixture(scope="module")
def engine(bpe_pair: ModelPair) -> Engine:
    return Engine(bpe_pair)


def run(engine: Engine, policy, constraint: Constraint, *, temperature=0.0, prompts=PROMPTS, max_tokens=160, **kw):
    requests = [
        Request(
            p,
            policy,
            SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, constraint=constraint, **kw),
        )
        for i, p in enumerate(prompts)
    ]
    return engine.generate(requests)


def valid(completions, schema) -> list[str]:
    for c in completions:
        assert c.finish_reason is FinishReason.STOP, c.text
        jsonschema.validate(json.loads(c.text), schema)
    return [c.text for c in completions]


# -- masks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_apply_bitmask_sets_exactly_the_forbidden_tokens_to_minus_inf(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, mask_words(vocab)), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    for row in range(3):
        for token in range(vocab):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)  # allowed logits unchanged bit for bit


# -- validation -------------------------------------------------------------------------------------


def test_bad_constraints_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="JSON"):
        Constraint.json_schema("{not json")
    with pytest.raises(ValueError, match="regex"):
        Constraint.regex("a(b")
    with pytest.raises(ValueError, match="lark"):
        Constraint.lark("start: missing_rule")
    with pytest.raises(ValueError, match="kind"):
        Constraint("yaml", "x")
    with pytest.raises(ValueError, match="Constraint"):
        SamplingParams(constraint={"type": "object"})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(constraint=Constraint.json_object(), ignore_eos=True)


def test_schema_sources_agree_and_keep_property_order() -> None:
    from pydantic import BaseModel
    from typing_extensions import TypedDict

    class Point(BaseModel):
        y: int
        x: int

    class PointDict(TypedDict):
        y: int
        x: int

    by_model, by_dict = Constraint.json_schema(Point), Constraint.json_schema(PointDict)
    assert list(json.loads(by_model.spec)["properties"]) == ["y", "x"]
    assert json.loads(by_dict.spec)["properties"].keys() == json.loads(by_model.spec)["properties"].keys()
    assert Constraint.json_schema(json.dumps(PERSON)) == Constraint.json_schema(PERSON)


# -- every model, every policy --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [LargeOnly(), SmallOnly(), EAD(threshold=1.0), EAD(threshold=0.5, window=1, min_dwell=1, lookahead=True), EASD()],
    ids=["large", "small", "ead", "ead-lookahead", "easd"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_policy_obeys_a_json_schema(engine: Engine, policy, temperature: float) -> None:
    out = run(engine, policy, Constraint.json_schema(PERSON), temperature=temperature)
    valid(out, PERSON)
    assert all(c.cost.small_tokens + c.cost.large_tokens == len(c.token_ids) for c in out)


@pytest.mark.parametrize(
    "policy",
    [SpeculativeDecoding(gamma=1), SpeculativeDecoding(gamma=4), SpeculativeDecoding(gamma=2, adaptive_gamma=True)],
    ids=["g1", "g4", "adaptive"],
)
def test_greedy_speculative_under_a_constraint_equals_large_only_under_it(engine: Engine, policy) -> None:
    for constraint in (Constraint.json_schema(PERSON), Constraint.regex(r"(ab|c[0-9]{1,3})+ (yes|no)")):
        expected = [c.text for c in run(engine, LargeOnly(), constraint)]
        got = run(engine, policy, constraint)
        assert [c.text for c in got] == expected
        assert sum(c.cost.extra.get("drafted_tokens", 0) for c in got) > 0


def test_sampled_speculative_under_a_constraint_is_valid_and_seeded(engine: Engine) -> None:
    constraint = Constraint.json_schema(PERSON)
    first = valid(run(engine, SpeculativeDecoding(gamma=3), constraint, temperature=1.0, top_p=0.9), PERSON)
    again = valid(run(engine, SpeculativeDecoding(gamma=3), constraint, temperature=1.0, top_p=0.9), PERSON)
    assert first == again


def test_regex_and_lark_constraints_hold(engine: Engine) -> None:
    pattern = r"[a-c]{2,5}-[0-9]{2}"
    for c in run(engine, EAD(threshold=0.5), Constraint.regex(pattern), temperature=1.0):
        assert re.fullmatch(pattern, c.text), c.text
    grammar = 'start: "SELECT " COL " FROM t" ("WHERE " COL "=" NUM)?\nCOL: /[a-z]{1,4}/\nNUM: /[0-9]{1,2}/'
    for c in run(engine, SpeculativeDecoding(gamma=3), Constraint.lark(grammar), temperature=1.0):
        assert re.fullmatch(r"SELECT [a-z]{1,4} FROM t(WHERE [a-z]{1,4}=[0-9]{1,2})?", c.text), c.text


def test_eager_branches_keep_their_own_grammar(engine: Engine) -> None:
    policy = EAGER(theta=0.05, percentile=0.0, max_paths=4, decoder=EAD(threshold=0.5))
    constraint = Constraint.json_schema(PERSON)
    requests = [Request(p, policy, SamplingParams(max_tokens=160, constraint=constraint)) for p in PROMPTS[:2]]
    events: dict[tuple[int, int], list] = {}
    for event in engine.stream(requests):
        events.setdefault((event.index, event.path), []).append(event)
    assert len(events) > 2  # branches happened
    for index, path in events:
        text = "".join(e.text for e in _full_path(events, index, path))
        jsonschema.validate(json.loads(text), PERSON)  # each path kept its own grammar state


def test_constrained_and_free_requests_share_a_batch(engine: Engine) -> None:
    constraint = Constraint.json_schema(PERSON)
    alone_free = engine.generate([Request("x", LargeOnly(), SamplingParams(max_tokens=12))])[0].text
    alone_json = run(engine, LargeOnly(), constraint, prompts=["Give JSON"])[0].text
    mixed = engine.generate(
        [
            Request("x", LargeOnly(), SamplingParams(max_tokens=12)),
            Request("Give JSON", LargeOnly(), SamplingParams(max_tokens=160, constraint=constraint)),
        ]
    )
    assert [c.text for c in mixed] == [alone_free, alone_json]


def test_preempted_constrained_sequences_resume_in_step(bpe_pair: ModelPair) -> None:
    constraint = Constraint.json_schema(PERSON)
    roomy = Engine(bpe_pair)
    expected = [c.text for c in run(roomy, SpeculativeDecoding(gamma=4), constraint, max_tokens=60)]
    tight = Engine(bpe_pair, kv_budget_tokens=72, kv_block_size=8)  # one request's worth of blocks
    got = run(tight, SpeculativeDecoding(gamma=4), constraint, max_tokens=60)
    assert tight.scheduler.preemptions > 0
    assert [c.text for c in got] == expected


def test_entropy_is_taken_after_the_mask(engine: Engine, bpe_pair: ModelPair) -> None:
    constraint = Constraint.regex(r"(yes|no|maybe)")
    out = run(engine, LargeOnly(), constraint, prompts=["Answer:"])[0]
    ids = engine.encode("Answer:")
    with torch.inference_mode():
        logits = bpe_pair.large.model(torch.tensor([ids])).logits[0, -1:].float()
    grammar = engine.grammars.start(constraint, len(ids))
    masked = logits.clone()
    apply_bitmask(masked, engine.grammars.masks([grammar])[0])
    assert out.entropies[0] == pytest.approx(float(entropy_bits(masked)[0]), abs=1e-4)
    assert out.entropies[0] < float(entropy_bits(logits)[0])


# -- hypothesis: generated schemas --------------------------------------------------------------------

LEAVES = st.sampled_from(
    [
        {"type": "boolean"},
        {"type": "null"},
        {"type": "integer", "minimum": -50, "maximum": 50},
        {"type": "string", "maxLength": 5},
        {"type": "string", "enum": ["red", "green", "blue"]},
        {"type": "string", "pattern": "^[a-z]{1,3}[0-9]$"},
        {"const": "fixed"},
    ]
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    keys = st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=1, max_size=3, unique=True)
    return keys.flatmap(
        lambda names: st.tuples(st.lists(children, min_size=len(names), max_size=len(names)), st.booleans()).map(
            lambda parts: {
                "type": "object",
                "properties": dict(zip(names, parts[0], strict=True)),
                "required": names if parts[1] else names[:1],
                "additionalProperties": False,
            }
        )
    )


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        _object(children),
        children.map(lambda item: {"type": "array", "items": item, "maxItems": 2}),
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 1.0]), policy=st.sampled_from(["ead", "spec", "small"]))
def test_generated_schemas_always_parse_and_validate(engine: Engine, schema, temperature: float, policy: str) -> None:
    chosen = {"ead": EAD(threshold=0.5), "spec": SpeculativeDecoding(gamma=3), "small": SmallOnly()}[policy]
    # every part of these schemas is bounded, so each output ends well within max_tokens
    out = run(
        engine, chosen, Constraint.json_schema(schema), temperature=temperature, prompts=PROMPTS[:2], max_tokens=512
    )
    valid(out, schema)


# -- tokenizers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy", [LargeOnly(), SmallOnly(), EAD(threshold=0.1), SpeculativeDecoding(gamma=3)], ids=lambda p: p.name
)
def test_a_character_level_vocabulary_takes_constraints(policy) -> None:
    """The embedded pair's tokenizer (one character per token, a Fuse decoder llguidance cannot read) is given to
    llguidance as its tokens' bytes: a regex holds whichever model writes."""
    from ead_llm import EntropyAdaptiveLLM

    llm = EntropyAdaptiveLLM(max_tokens=12, temperature=1.0)
    pattern = r"#### [0-9]{1,5}\n?"
    prompts = ["4821+3907-1568\n", "1200+3400-2222\n", "9999-1234+5678\n"]
    texts = [llm.invoke(p, regex=pattern, policy=policy) for p in prompts]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    if isinstance(policy, SpeculativeDecoding):  # lossless under the constraint, on this vocabulary too
        greedy = llm.invoke(prompts[0], regex=pattern, policy=policy, temperature=0.0)
        assert greedy == llm.invoke(prompts[0], regex=pattern, policy=LargeOnly(), temperature=0.0)


def test_a_constraint_the_vocabulary_cannot_spell_is_refused_before_it_runs() -> None:
    from ead_llm import EntropyAdaptiveLLM

    llm = EntropyAdaptiveLLM(max_tokens=12)
    with pytest.raises(ValueError, match=r"no token of this vocabulary can continue the constraint.*'\{'"):
        llm.invoke("4821+3907-1568\n", json_schema={"type": "object"})
    assert llm.shared_engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


def test_a_tokenizer_llguidance_cannot_read_is_refused_in_one_sentence(tmp_path) -> None:
    """A word-level tokenizer joins its tokens with spaces: neither readable by llguidance nor concatenative."""
    from ead_llm.core.grammar import SUPPORTED_TOKENIZERS, grammar_tokenizer
    from ead_llm.testing.tiny import big_vocab_tokenizer

    tokenizer = big_vocab_tokenizer(300)
    with pytest.raises(ValueError, match="constrained decoding needs a fast Hugging Face tokenizer") as refused:
        grammar_tokenizer(tokenizer, 300, frozenset({1}))
    assert str(refused.value).startswith(SUPPORTED_TOKENIZERS)


def test_a_tokenizer_llguidance_cannot_read_still_decodes_free_text(tmp_path) -> None:
    """The grammar machinery is built only for a constrained request: a pair whose tokenizer llguidance cannot
    read decodes unconstrained requests under every kind of pass (sampled and verified rows), and refuses a
    constrained one in its sentence, without failing the others."""
    from ead_llm import EntropyAdaptiveLLM, LargeOnly, SpeculativeDecoding
    from ead_llm.testing.tiny import big_vocab_tokenizer, build_tiny_pair

    small, large = build_tiny_pair(tmp_path, tokenizer=big_vocab_tokenizer(300))
    for policy in (LargeOnly(), SpeculativeDecoding(gamma=3)):
        llm = EntropyAdaptiveLLM(small=str(small), large=str(large), policy=policy, max_tokens=6)
        result = llm.generate(["t1 t2 t4", "t5 t6"])
        assert [len(g[0].generation_info["token_ids"]) for g in result.generations] == [6, 6]
        with pytest.raises(ValueError, match="constrained decoding needs a fast Hugging Face tokenizer"):
            llm.invoke("t7", regex="[ab]+")
        assert llm.shared_engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
