"""Train a feature-reading draft (:mod:`ead_llm.drafts.model`) for a causal LM from the model's own answers.

    ead-llm distill --large MODEL --out DIR [--minutes M | --steps N] [--seed S]

1. The target writes answers to a fixed, seeded set of chat questions through the engine (one greedy answer
   and ``samples - 1`` sampled at temperature 0.8, top-p 0.95): the text a draft meets. With ``own_questions``,
   the target also writes that many questions itself, its chat template opened for a user's turn and left for it
   to fill (Magpie, Xu et al. 2024): questions as varied as what it was tuned on, answered ``own_samples`` times.
2. Its final hidden states on that text are kept as the engine computes them while writing it (no second
   forward): they are the draft's inputs, and its head on them gives the next-token distributions the draft
   learns.
3. The draft's head keeps the ``vocab`` tokens the target wrote most often (FR-Spec); its ``layers`` layers (1 by
   default) start as the target's last ones; its layers, join and norm are trained (the embeddings and head rows
   stay the target's) to minimise the cross-entropy of the target's distribution (restricted to the head's tokens)
   plus a smooth-L1 pull of its output toward the target's feature, for ``minutes`` or ``steps`` steps (AdamW, a
   cosine decay). Prompt positions mostly get zero features, as in the engine when the draft reads a prompt
   before the target. With ``depth`` above 1, training-time test (:mod:`ead_llm.drafts.unroll`) takes over from
   ``unroll_from`` of training: the loss then also covers the second to ``depth``-th token of a round, drafted on
   the draft's own guesses of the features (teacher forced first: the cheaper passes reach the first token's
   agreement sooner, and the unrolled ones then lift the later tokens').
4. Top-1 agreement with the target is measured on answers to held-out questions (not only held-out answers),
   and the draft's own weights are saved with a card; the target's embeddings are copied in when it is
   assembled (:func:`ead_llm.drafts.model.assemble`).

Seeded: the questions, the split, the batches and the initial weights follow ``--seed``. A time budget makes the
number of steps depend on the machine; ``--steps`` gives the same draft again on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from ead_llm.core.fused_llama import bfloat16_native
from ead_llm.drafts import DATA_DTYPES, add_arguments, prefer_huge_pages
from ead_llm.drafts.model import (
    OWN,
    FeatureDraft,
    card_files,
    check_shape,
    new_draft,
    own_state,
    previous,
    register,
    save_folder,
)
from ead_llm.drafts.unroll import unrolled

if TYPE_CHECKING:
    from ead_llm.core.engine import Engine
    from ead_llm.core.request import Completion, Request

TOPICS = [
    "the moon",
    "volcanoes",
    "photosynthesis",
    "the Roman Empire",
    "prime numbers",
    "bicycles",
    "coffee",
    "the ocean",
    "rainbows",
    "honey bees",
    "the internet",
    "chess",
    "the heart",
    "gravity",
    "bread",
    "penguins",
    "electricity",
    "the Eiffel Tower",
    "clouds",
    "vaccines",
    "the piano",
    "deserts",
    "trains",
    "recycling",
    "the alphabet",
    "glaciers",
    "owls",
    "solar panels",
    "the Nile",
    "friendship",
    "maps",
    "tea",
    "earthquakes",
    "the printing press",
    "dolphins",
    "algebra",
    "umbrellas",
    "Mars",
    "soap",
    "forests",
    "money",
    "music",
    "sleep",
    "robots",
    "rivers",
    "libraries",
    "football",
    "the sun",
    "birds",
    "cooking",
    "languages",
    "islands",
    "computers",
    "democracy",
    "dinosaurs",
    "weather",
    "gardens",
    "mountains",
    "planes",
    "history",
]
MORE_TOPICS = [
    "snow",
    "whales",
    "the brain",
    "bridges",
    "cheese",
    "spiders",
    "the Moon landing",
    "magnets",
    "kites",
    "batteries",
    "tigers",
    "the Great Wall of China",
    "wind",
    "chocolate",
    "ants",
    "telescopes",
    "the Amazon rainforest",
    "pyramids",
    "lightning",
    "rice",
    "octopuses",
    "the calendar",
    "thunderstorms",
    "elephants",
    "paper",
    "clocks",
    "coral reefs",
    "jazz",
    "the stock market",
    "fire",
    "salt",
    "sharks",
    "the Olympics",
    "tornadoes",
    "apples",
    "butterflies",
    "airports",
    "stars",
    "the human skeleton",
    "wolves",
    "newspapers",
    "yoga",
    "lakes",
    "pizza",
    "submarines",
    "volunteering",
    "frogs",
    "the water cycle",
    "kangaroos",
    "cars",
    "shoes",
    "the telephone",
    "mushrooms",
    "camping",
    "comets",
    "museums",
    "bees and flowers",
    "oxygen",
    "painting",
    "the wheel",
]
"""Topics asked after the first set (in their own seeded order after it, so the first questions keep their
indices and an earlier data file stays valid)."""
TEMPLATES = (
    "Tell me one interesting fact about {t}.",
    "Explain {t} to a child in two sentences.",
    "Write a short poem about {t}.",
    "What are three things people should know about {t}?",
    "Give me a one-sentence summary of {t}.",
    "Why does {t} matter?",
    "Describe {t} in a few words.",
    "Write a short story that mentions {t}.",
    "What is a common misconception about {t}?",
    "List two questions a student might ask about {t}.",
    "What is the history of {t}?",
    "How would you explain {t} to a friend?",
)
ARITHMETIC = ("What is {a} plus {b}?", "What is {a} times {b}?", "Is {a} larger than {b}?", "What is {a} minus {b}?")
FACTS = (
    "What is the capital of {c}?",
    "Which continent is {c} in?",
    "What language is spoken in {c}?",
)
COUNTRIES = [
    "Peru",
    "Kenya",
    "Norway",
    "Vietnam",
    "Chile",
    "Egypt",
    "Poland",
    "Canada",
    "Brazil",
    "Japan",
    "Ghana",
    "Sweden",
    "Turkey",
    "Mexico",
    "India",
    "Spain",
    "Greece",
    "Nepal",
    "Cuba",
    "Iran",
    "Italy",
    "Chad",
    "Fiji",
    "Laos",
]


def questions(seed: int) -> list[str]:
    """The fixed set of questions (topics, facts and small arithmetic), shuffled by ``seed``."""
    rng = random.Random(seed)
    out = [template.format(t=topic) for topic in TOPICS for template in TEMPLATES]
    out += [template.format(c=country) for country in COUNTRIES for template in FACTS]
    out += [rng.choice(ARITHMETIC).format(a=rng.randint(2, 99), b=rng.randint(2, 99)) for _ in range(150)]
    rng.shuffle(out)
    more = [template.format(t=topic) for topic in MORE_TOPICS for template in TEMPLATES]
    rng.shuffle(more)
    return out + more


OWN_QUESTION_TOKENS = 64
"""Longest question the target may write itself; one running past it is dropped (it was cut, not asked)."""
OWN_QUESTION_TEMPERATURE, OWN_QUESTION_TOP_P = 1.0, 0.95
"""How the target samples its own questions."""


def own_questions_written_as(seed: int) -> dict[str, float]:
    """How own questions are written (kept with them: a data file's questions are reused only if it is equal)."""
    return {
        "seed": seed,
        "temperature": OWN_QUESTION_TEMPERATURE,
        "top_p": OWN_QUESTION_TOP_P,
        "max_tokens": OWN_QUESTION_TOKENS,
    }


def user_turn(tokenizer: Any) -> str:
    """The chat template's text up to where a user's words go: what the model continues with a question."""
    marker = "\u2063ead-llm-question\u2063"
    text = str(tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False))
    if marker not in text:
        raise ValueError("the target's chat template does not write the user's words; it cannot ask own questions")
    return text[: text.index(marker)]


def own_questions(model_dir: str, indices: list[int], seed: int, dtype: str | None) -> dict[int, str]:
    """Question ``i`` of ``indices`` the target writes itself (Magpie): its chat template opened for a user's turn,
    continued at temperature 1, top-p 0.95, seeded by ``seed`` and ``i`` (the same question whatever else is
    asked with it). A question the model did not end within :data:`OWN_QUESTION_TOKENS` tokens comes back as
    ``""`` (not asked)."""
    from ead_llm import LargeOnly
    from ead_llm.core.request import Request, SamplingParams

    with target_engine(model_dir, dtype) as engine:
        opened = user_turn(engine.tokenizer)
        params = SamplingParams(
            temperature=OWN_QUESTION_TEMPERATURE, top_p=OWN_QUESTION_TOP_P, max_tokens=OWN_QUESTION_TOKENS, seed=seed
        )
        done = generated(engine, [Request(opened, LargeOnly(), params, sample_index=i) for i in indices])
    return {i: c.text.strip() if c.finish_reason == "stop" else "" for i, c in zip(indices, done, strict=True)}


def own_questions_kept(source: str, count: int, seed: int, data: str | None) -> list[str]:
    """The first ``count`` questions the target writes itself (:func:`own_questions`); with ``data``, kept beside
    it (``data + '.questions'``) and only the missing ones written. A data file whose questions were written
    otherwise (another seed or sampling) is refused: its answers belong to those questions."""
    if count == 0:
        return []
    cached = Path(data + ".questions") if data else None
    kept: dict[int, str] = {}
    written_as = own_questions_written_as(seed)
    if cached is not None and cached.exists():
        stored = json.loads(cached.read_text())
        if stored.get("written_as") != written_as:
            raise ValueError(
                f"{data}'s own questions were written as {stored.get('written_as')}, not {written_as}: "
                "use another --data file"
            )
        kept = {int(i): q for i, q in stored["questions"].items()}
    missing = [i for i in range(count) if i not in kept]
    if missing:
        kept.update(own_questions(source, missing, seed, None))
        if cached is not None:
            questions = {str(i): q for i, q in sorted(kept.items())}
            cached.write_text(json.dumps({"written_as": written_as, "questions": questions}))
    return [kept[i] for i in range(count)]


OWN_FIRST = 1_000_000
"""Index of the first question the target writes itself (the set's questions keep theirs, whatever their count,
so that a data file's answers stay with their questions)."""


def is_own(question: int) -> bool:
    """Whether question index ``question`` is one the target wrote itself."""
    return question >= OWN_FIRST


def asked_once(asked: dict[int, str], kept: set[int]) -> set[int]:
    """``kept`` without blank questions and without any question asked at a lower index."""
    first: dict[str, int] = {}
    for i in sorted(asked):
        first.setdefault(asked[i], i)
    return {i for i in kept if asked[i] and first[asked[i]] == i}


@dataclass
class Example:
    """A chat prompt and one of the target's answers, with the target's features and greedy next tokens."""

    question: int
    ids: list[int]
    start: int
    """First position whose next-token distribution is a target (the last prompt token)."""
    sample: int = 0
    """Which of the question's answers: 0 greedy, the others sampled."""
    features: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [len(ids), H]
    best: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [len(ids) - 1 - start]: target's argmax
    written_as: dict[str, float | str] | None = None
    """How the answer was written (:func:`answers_written_as`); None in data files from before it was kept."""


ANSWER_TEMPERATURE, ANSWER_TOP_P = 0.8, 0.95
"""How the target samples the answers after the first (greedy) one."""


def answers_written_as(seed: int, max_tokens: int, dtype: str | None = None) -> dict[str, float | str]:
    """How answers are written (kept with them: a data file's answers are reused only if it is equal); ``dtype``:
    the target's when it was not float32 (:data:`DATA_DTYPES`)."""
    how: dict[str, float | str] = {
        "seed": seed,
        "max_tokens": max_tokens,
        "temperature": ANSWER_TEMPERATURE,
        "top_p": ANSWER_TOP_P,
    }
    return how if dtype in (None, "float32") else {**how, "dtype": str(dtype)}


def written(
    model_dir: str,
    prompts: dict[int, str],
    wanted: list[tuple[int, int]],
    seed: int,
    max_tokens: int,
    dtype: str | None,
) -> list[Example]:
    """The target's answers through the engine to each ``(question, sample)`` of ``wanted`` (indices into
    ``prompts``), with its features: sample 0 greedy, the others at :data:`ANSWER_TEMPERATURE` and
    :data:`ANSWER_TOP_P`, each seeded by ``seed`` and its sample index (the same answer whatever else is asked with
    it)."""
    from ead_llm import LargeOnly
    from ead_llm.adapters.prompts import render
    from ead_llm.core.request import Request, SamplingParams

    with target_engine(model_dir, dtype, return_hidden_states=True) as engine:
        head = engine.pair.large.model.get_output_embeddings()
        requests = []
        for q, k in wanted:
            rendered = render(engine.tokenizer, [("user", prompts[q])], "chat")
            hot = k > 0
            params = SamplingParams(
                temperature=ANSWER_TEMPERATURE if hot else 0.0,
                top_p=ANSWER_TOP_P if hot else 1.0,
                max_tokens=max_tokens,
                seed=seed,
            )
            requests.append(Request(rendered, LargeOnly(), params, sample_index=k))
        out = []
        written_as = answers_written_as(seed, max_tokens, dtype)
        for first in range(0, len(requests), CHUNK):
            chunk = []
            part = requests[first : first + CHUNK]
            for request, (q, k), done in zip(part, wanted[first : first + CHUNK], engine.generate(part), strict=True):
                ids = engine.encode(request.prompt)
                assert done.hidden_states is not None
                answer = Example(q, ids + list(done.token_ids), len(ids) - 1, k, done.hidden_states)
                answer.written_as = written_as
                chunk.append(answer)
            with_best(head, chunk)
            out += chunk
        return out


def with_best(head: Any, chunk: list[Example]) -> None:
    """Make the examples' features one float32 tensor (each example's a view; the last position, never read, zero)
    and keep the target's best next token over each answer: a greedy answer's own tokens, a sampled answer's the
    head's argmax on its features.

    One tensor per chunk, and the head's logits a slice of rows at a time: a tensor per example (each features'
    copy, and more so a logits tensor of 10-20 MB, from the heap once glibc's mmap threshold had risen) fragmented
    the heap around the features kept between them until the process held 20 times their size."""
    lengths = [len(e.ids) for e in chunk]
    whole = torch.zeros((sum(lengths), chunk[0].features.shape[-1]))
    at = 0
    for example, length in zip(chunk, lengths, strict=True):
        whole[at : at + length - 1] = example.features.float()
        example.features = whole[at : at + length]
        at += length
    sampled = [e for e in chunk if e.sample]
    for example in chunk:
        if not example.sample:
            example.best = torch.tensor(example.ids[example.start + 1 :])
    if sampled:
        rows = torch.cat([e.features[e.start : len(e.ids) - 1] for e in sampled]).to(head.weight.dtype)
        with torch.no_grad():
            best = torch.cat([head(rows[i : i + HEAD_ROWS]).argmax(-1) for i in range(0, len(rows), HEAD_ROWS)])
        for example, mine in zip(sampled, best.split([len(e.ids) - 1 - e.start for e in sampled]), strict=True):
            example.best = mine


HEAD_ROWS = 1024
"""Rows of features the head reads at once for the best tokens (their logits well past glibc's mmap threshold)."""


@contextlib.contextmanager
def target_engine(model_dir: str, dtype: str | None, *, return_hidden_states: bool = False) -> Iterator[Engine]:
    """An engine running the target alone (both roles), closed on leaving."""
    from ead_llm.core.engine import Engine
    from ead_llm.core.loading import LoadConfig, load_pair

    pair = load_pair(LoadConfig(small=model_dir, large=model_dir, device="cpu", dtype=dtype))
    engine = Engine(pair, return_hidden_states=return_hidden_states)
    try:
        yield engine
    finally:
        engine.close()


CHUNK = 64
"""Requests given to the engine at once (so that at most as many rows' caches, and their features, are held)."""


def generated(engine: Engine, requests: list[Request]) -> list[Completion]:
    """The requests' completions, :data:`CHUNK` requests at a time."""
    return [
        done for first in range(0, len(requests), CHUNK) for done in engine.generate(requests[first : first + CHUNK])
    ]


def gathered(
    source: str,
    asked: dict[int, str],
    kept: dict[int, int],
    seed: int,
    max_tokens: int,
    data: str | None,
    dtype: str | None = None,
    held: frozenset[int] = frozenset(),
) -> list[Example]:
    """The target's answers (``kept[q]`` to each question ``q``) with their features, written in ``dtype``
    (:data:`DATA_DTYPES`) but for the ``held`` questions', written in float32.

    With ``data``, what the file holds is reused and only the missing answers are written (a second run with more
    questions or samples adds to it; an answer written in another precision than this run's is written again). A file
    whose answers were written otherwise (another seed, length or sampling) is refused: they are not this run's
    answers."""
    cached = Path(data) if data else None
    examples: list[Example] = torch.load(cached, weights_only=False) if cached and cached.exists() else []
    written_as = answers_written_as(seed, max_tokens)
    other = next(
        (e.written_as for e in examples if e.written_as is not None and _but_dtype(e.written_as) != written_as), None
    )
    if other is not None:
        raise ValueError(f"{data}'s answers were written as {other}, not {written_as}: use another --data file")

    def wanted_as(question: int) -> dict[str, float | str]:
        return answers_written_as(seed, max_tokens, None if question in held else dtype)

    fits = [e for e in examples if (e.written_as or written_as) == wanted_as(e.question)]
    have = {(e.question, e.sample) for e in fits}
    missing = [(q, k) for q in sorted(kept) for k in range(kept[q]) if (q, k) not in have]
    if missing:
        exact = [(q, k) for q, k in missing if wanted_as(q) == written_as]
        rest = [(q, k) for q, k in missing if wanted_as(q) != written_as]
        rewritten = set(missing)  # (answers this run does not ask for stay as they were, whatever their precision)
        examples = [e for e in examples if (e.question, e.sample) not in rewritten] + [
            e
            for part, how in ((exact, None), (rest, dtype))
            if part
            for e in written(source, asked, part, seed, max_tokens, how)
        ]
        if cached is not None:
            torch.save(examples, cached)
    return [e for e in examples if e.sample < kept.get(e.question, 0)]


def _but_dtype(written_as: dict[str, float | str]) -> dict[str, float | str]:
    return {k: v for k, v in written_as.items() if k != "dtype"}


def batches(examples: list[Example], size: int) -> list[list[Example]]:
    ordered = sorted(examples, key=lambda e: len(e.ids))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def padded(group: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] (right-padded with 0) and the mask of real tokens [B, T]."""
    width = max(len(e.ids) for e in group)
    ids = torch.zeros((len(group), width), dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for row, example in enumerate(group):
        ids[row, : len(example.ids)] = torch.tensor(example.ids)
        mask[row, : len(example.ids)] = 1
    return ids, mask


def frequent_tokens(examples: list[Example], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The ``size`` tokens the target wrote most often (``always`` first; ties and the rest by id)."""
    counts = Counter(t for e in examples for t in e.ids[e.start + 1 :])
    chosen = list(dict.fromkeys([*always, *(t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))]))
    chosen = chosen[:size]
    if len(chosen) < size:
        taken = set(chosen)
        chosen += [t for t in range(vocab) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def inputs_of(
    group: list[Example], zero_prompt: list[bool], noise: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and the feature each position reads [B, T, H] (its predecessor's; zeros over prompts
    where ``zero_prompt``), with uniform noise of width ``noise`` on real features."""
    ids, _ = padded(group)
    width = ids.shape[1]
    features = torch.stack([F.pad(e.features, (0, 0, 0, width - len(e.ids))) for e in group])
    shifted = previous(features)
    for row, example in enumerate(group):
        if zero_prompt[row]:
            shifted[row, : example.start + 1] = 0.0  # positions 0..start read features of prompt positions
    if noise:
        shifted = shifted + (torch.rand(shifted.shape, generator=generator) - 0.5) * noise * (shifted != 0)
    return ids, shifted


def _answer_index(group: list[Example]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The (row, position) index of every answer position of ``group`` (each predicts the next token), and each
    one's distance from its answer's start."""
    rows, cols, offsets = [], [], []
    for row, example in enumerate(group):
        span = range(example.start, len(example.ids) - 1)
        rows += [row] * len(span)
        cols += list(span)
        offsets += [c - example.start for c in span]
    return (torch.tensor(rows), torch.tensor(cols)), torch.tensor(offsets)


def answer_window(group: list[Example]) -> tuple[torch.Tensor, int]:
    """Where each row's answer positions start, and the most any row has: the window :func:`unrolled` computes."""
    return torch.tensor([e.start for e in group]), max(1, max(len(e.ids) - 1 - e.start for e in group))


Reader = Callable[[FeatureDraft, list[Example], list[bool], float, Any], tuple[torch.Tensor, torch.Tensor]]
"""What the positions of a batch read: ``(draft, group, zero_prompt, noise, generator) -> (ids, features)``."""


def final_states(
    draft: FeatureDraft, group: list[Example], zero_prompt: list[bool], noise: float, gen: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped drafts' reading: the target's final state at the position before (:func:`inputs_of`)."""
    return inputs_of(group, zero_prompt, noise, gen)


def loss_of(
    draft: FeatureDraft,
    group: list[Example],
    zero_prompt: list[bool],
    noise: float,
    gen: Any,
    depth: int = 1,
    read: Reader = final_states,
    *,
    feature_weight: float = 1.0,
    top1_weight: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of the target's head distribution (over the draft's tokens), plus ``feature_weight`` times the
    smooth-L1 distance of the draft's outputs from the target's features, plus ``top1_weight`` times the
    cross-entropy of the target's best token alone, over answer positions, averaged over ``depth`` passes of
    training-time test (:mod:`ead_llm.drafts.unroll`): pass ``j`` counts the positions at least ``j`` into an
    answer, the ``j``-th token of a round that started there."""
    ids, feats = read(draft, group, zero_prompt, noise, gen)
    index, offsets = _answer_index(group)
    truth = torch.stack([group[r].features[c] for r, c in zip(index[0].tolist(), index[1].tolist(), strict=True)])
    with torch.no_grad():
        teacher = torch.softmax(draft.head(truth.to(draft.head.weight.dtype)).float(), dim=-1)
        best = teacher.argmax(-1) if top1_weight else None  # only where that term is counted: every step reads this
    total = torch.zeros(())
    for j, out in enumerate(unrolled(draft, ids, feats, depth, *answer_window(group))):
        counted = offsets >= j
        guess = out[index[0], offsets][counted]
        logp = torch.log_softmax(draft.head(guess).float(), dim=-1)
        term = -(teacher[counted] * logp).sum(-1).mean()
        if feature_weight:
            term = term + feature_weight * F.smooth_l1_loss(guess.float(), truth[counted])
        if best is not None:
            term = term + top1_weight * F.nll_loss(logp, best[counted])
        total = total + term  # summed as before the weights: the default's loss keeps its bits
    return total / depth


@torch.no_grad()
def agreement(
    draft: FeatureDraft,
    examples: list[Example],
    *,
    zero_prompt: bool = True,
    depth: int = 1,
    read: Reader = final_states,
) -> list[float]:
    """How often the draft's best token is the target's over the answer positions of ``examples``, for each of
    ``depth`` passes: pass 0 teacher forced (each position reads the target's feature of the one before; zero
    features over the prompt), pass ``j`` as the ``j``-th token of a round (its own guesses before it), over the
    positions at least ``j`` into an answer."""
    same, total = [0] * depth, [0] * depth
    for group in batches(examples, 16):
        ids, feats = read(draft, group, [zero_prompt] * len(group), 0.0, None)
        for j, out in enumerate(unrolled(draft, ids, feats, depth, *answer_window(group))):
            best = draft.vocab_index[draft.head(out).argmax(-1)]  # type: ignore[index]
            for row, example in enumerate(group):
                mine = best[row, j : len(example.ids) - 1 - example.start]
                same[j] += int((mine == example.best[j:]).sum())
                total[j] += mine.numel()
    return [s / max(1, t) for s, t in zip(same, total, strict=True)]


REPORTED_STEPS = 3
"""Tokens of a round whose agreement the card reports (the first teacher forced, the later on the draft's own)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ead-llm distill", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check parsed options (a ``ValueError`` naming the option) and distill; return the card."""
    prefer_huge_pages()  # both entry points come here before torch allocates anything (importing it does not)
    for name in (
        "steps",
        "layers",
        "mlp_width",
        "vocab",
        "samples",
        "questions",
        "max_tokens",
        "batch",
        "depth",
        "threads",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.own_questions < 0 or args.own_samples < 1:
        raise ValueError(
            f"--own-questions must be at least 0 and --own-samples at least 1, got {args.own_questions} and "
            f"{args.own_samples}"
        )
    if not args.minutes > 0 or not args.lr > 0:
        raise ValueError(f"--minutes and --lr must be positive, got {args.minutes} and {args.lr}")
    if not 0.0 <= args.unroll_from < 1.0:
        raise ValueError(f"--unroll-from is a share of training in [0, 1), got {args.unroll_from}")
    from ead_llm.core.sources import check_source, model_source

    source = model_source("--large", args.large)
    check_source("--large", source)
    keywords = {k for k, p in inspect.signature(distill).parameters.items() if p.kind is p.KEYWORD_ONLY}
    options = {k: v for k, v in vars(args).items() if k in keywords}  # the CLI's own (e.g. func) left out
    return distill(source, Path(args.out), **options)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and save a draft; return its card."""
    p = parser()
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        p.error(str(err))
        raise


def distill(
    source: str,
    out: Path,
    *,
    minutes: float = 60.0,
    steps: int | None = None,
    seed: int = 0,
    layers: int = 1,
    mlp_width: int = 1,
    vocab: int = 8192,
    samples: int = 4,
    questions: int | None = None,
    own_questions: int = 0,
    own_samples: int = 1,
    max_tokens: int = 128,
    lr: float = 1e-3,
    batch: int = 16,
    depth: int = 1,
    unroll_from: float = 0.5,
    bfloat16: bool = False,
    threads: int | None = None,
    data: str | None = None,
    data_dtype: str = "float32",
    exclude: str | Sequence[str] | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """See the module docstring; returns the card written beside the draft."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if data_dtype not in DATA_DTYPES:
        raise ValueError(f"--data-dtype must be one of {DATA_DTYPES}, got {data_dtype!r}")
    check_shape(int(AutoConfig.from_pretrained(source).num_hidden_layers), layers, mlp_width)  # before any data
    if data is not None:
        Path(data).parent.mkdir(parents=True, exist_ok=True)  # not found missing after an hour of answers
    bfloat16, data_dtype, declined = in_hardware(bfloat16=bfloat16, data_dtype=data_dtype, native=bfloat16_native())
    if declined:
        log(declined)

    register()
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    asked = questions_of(seed, questions)
    written_own = own_questions_kept(source, own_questions, seed, data)
    asked.update({OWN_FIRST + i: q for i, q in enumerate(written_own)})
    kept = asked_once(asked, excluded(asked, exclude))
    rng = random.Random(seed)
    held_questions = held_out_of_both(kept, rng)
    per_question = {q: own_samples if is_own(q) else samples for q in kept}
    examples = gathered(source, asked, per_question, seed, max_tokens, data, data_dtype, frozenset(held_questions))
    target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    held = [e for e in examples if e.question in held_questions]
    train = [e for e in examples if e.question not in held_questions]
    if not train or not held:
        raise ValueError("too few questions to hold some out and train on the rest: use more questions")
    eos = target.generation_config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    index = frequent_tokens(train, min(vocab, int(target.config.vocab_size)), int(target.config.vocab_size), always)
    coverage = sum(int(torch.isin(torch.tensor(e.ids[e.start + 1 :]), index).sum()) for e in held) / max(
        1, sum(len(e.ids) - e.start - 1 for e in held)
    )
    torch.manual_seed(seed)
    draft = new_draft(target, index, layers, mlp_width).float()
    del target
    before = agreement(draft.eval(), held)[0]
    data_s = time.perf_counter() - started
    log(
        f"data: {len(train)} answers to train on, {len(held)} to {len(held_questions)} held-out questions, "
        f"{data_s:.0f} s; head covers {coverage:.3f} of held-out tokens; top-1 agreement {before:.3f}"
    )
    trainable = [p for name, p in draft.named_parameters() if name.startswith(OWN)]
    for param in draft.parameters():
        param.requires_grad = False
    for param in trainable:
        param.requires_grad = True
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    groups = batches(train, batch)
    generator = torch.Generator().manual_seed(seed)
    deadline = time.perf_counter() + minutes * 60
    done_steps = tokens = 0

    def progress() -> float:
        if steps is not None:
            return done_steps / steps
        return 1.0 - (deadline - time.perf_counter()) / (minutes * 60)

    draft.train()
    while progress() < 1.0:
        rng.shuffle(groups)
        for group in groups:
            done = progress()
            if done >= 1.0:
                break
            warm = min(1.0, (done_steps + 1) / 50)
            for setting in optimizer.param_groups:
                setting["lr"] = lr * warm * (0.05 + 0.475 * (1.0 + math.cos(math.pi * min(1.0, done))))
            zero_prompt = [rng.random() < 0.75 for _ in group]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
                passes = depth if done >= unroll_from else 1
                loss = loss_of(draft, group, zero_prompt, 0.2, generator, passes)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            done_steps += 1
            tokens += sum(len(e.ids) - 1 - e.start for e in group)
            if done_steps % 100 == 0:
                minutes_in = (time.perf_counter() - started) / 60
                log(f"step {done_steps}: loss {float(loss.detach()):.3f} ({minutes_in:.1f} min)")
    draft.eval()
    for param in draft.parameters():
        param.requires_grad = False
    after = agreement(draft, held, depth=REPORTED_STEPS)
    after_real_prompt = agreement(draft, held, zero_prompt=False)[0]
    after_greedy = agreement(draft, [e for e in held if e.sample == 0], depth=REPORTED_STEPS)
    own_train = sum(1 for e in train if is_own(e.question))
    own_asked = len({e.question for e in train if is_own(e.question)})
    own_text = (
        f"; and {own_train} answers ({own_samples} each: the first greedy) to {own_asked} questions it wrote itself "
        f"(Magpie: its chat template opened for a user's turn, temperature {OWN_QUESTION_TEMPERATURE:g}, top-p "
        f"{OWN_QUESTION_TOP_P:g}, up to {OWN_QUESTION_TOKENS} tokens; {own_questions} asked)"
        if own_questions
        else ""
    )
    card = {
        "target": source,
        "design": f"{layers} decoder layer(s)"
        + (f" with {mlp_width} times the target's MLP units" if mlp_width > 1 else "")
        + " over the target's final hidden states and token embeddings (EAGLE-style), "
        f"head restricted to the target's {index.numel()} most frequent tokens (FR-Spec)",
        "data": f"{len(train) - own_train} answers the target wrote to "
        f"{len({e.question for e in train}) - own_asked} seeded chat questions "
        f"(1 greedy and {samples - 1} sampled at temperature {ANSWER_TEMPERATURE:g}, top-p {ANSWER_TOP_P:g}, up to "
        f"{max_tokens} tokens){own_text}",
        "objective": "cross-entropy of the target's distribution over the head's tokens + smooth L1 to its features"
        + (f", over {depth} passes of training-time test from {unroll_from:g} of training on" if depth > 1 else ""),
        "steps": done_steps,
        "target_tokens": tokens,
        "lr": lr,
        "batch": batch,
        "precision": "bfloat16 autocast" if bfloat16 else "float32",
        "data_dtype": f"training answers written in {data_dtype}, held-out ones in float32",
        **({"bfloat16_declined": declined} if declined else {}),
        "seed": seed,
        "budget": f"{steps} steps" if steps is not None else f"{minutes:g} minutes",
        "seconds_total": round(time.perf_counter() - started),
        "held_out_questions": len(held_questions),
        "held_out_answers": len(held),
        "head_coverage": round(coverage, 4),
        "top1_agreement_before": round(before, 4),
        "top1_agreement_after": round(after[0], 4),
        "top1_agreement_after_with_prompt_features": round(after_real_prompt, 4),
        "top1_agreement_after_greedy_answers": round(after_greedy[0], 4),
        "top1_agreement_by_round_token": _rounded(after),
        "top1_agreement_by_round_token_greedy_answers": _rounded(after_greedy),
        **(
            {
                "top1_agreement_by_round_token_set_questions": _rounded(
                    agreement(draft, [e for e in held if not is_own(e.question)], depth=REPORTED_STEPS)
                ),
                "top1_agreement_by_round_token_own_questions": _rounded(
                    agreement(draft, [e for e in held if is_own(e.question)], depth=REPORTED_STEPS)
                ),
            }
            if own_questions
            else {}
        ),
        "own_parameters": sum(v.numel() for k, v in own_state(draft).items() if k != "vocab_index"),
    }
    save(draft, tokenizer, out, card)
    log(json.dumps(card, indent=1))
    return card


def in_hardware(*, bfloat16: bool, data_dtype: str, native: bool) -> tuple[bool, str, str]:
    """The training precision and the answers' dtype to use, and why bfloat16 asked for was declined ("" if it was
    not): without bfloat16 arithmetic in the CPU (``native``: AVX-512 BF16 or AMX) torch emulates it. Measured on
    a Zen 3 with SmolLM2: a training step under bfloat16 autocast 27x as long as in float32, and a run writing 80
    answers in bfloat16 158 s against 43 s."""
    if native or not (bfloat16 or data_dtype == "bfloat16"):
        return bfloat16, data_dtype, ""
    return (
        False,
        "float32",
        (
            "bfloat16 asked, float32 used: this CPU has no bfloat16 arithmetic (AVX-512 BF16 or AMX), and torch's "
            "emulation of it runs several times slower than float32"
        ),
    )


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


def excluded(asked: dict[int, str], exclude: str | Sequence[str] | None) -> set[int]:
    """Indices of the questions to use: all but those in the file or files ``exclude`` (JSON lines with a
    ``prompt``, or one question per line), e.g. a benchmark's prompts, so that it measures the draft on questions it
    never saw."""
    if exclude is None:
        return set(asked)
    files = [exclude] if isinstance(exclude, str) else list(exclude)
    lines = [line.strip() for f in files for line in Path(f).read_text().splitlines() if line.strip()]
    banned = {json.loads(line)["prompt"] if line.startswith("{") else line for line in lines}
    return {i for i, q in asked.items() if q not in banned}


def held_out_of_both(kept: set[int], rng: random.Random) -> set[int]:
    """The held-out questions: the set's tenth (the one drawn without own questions), then the own questions'."""
    return held_out({q for q in kept if not is_own(q)}, rng) | held_out({q for q in kept if is_own(q)}, rng)


def held_out(kept: set[int], rng: random.Random) -> set[int]:
    """The tenth of the ``kept`` questions (at least one) whose answers are held out, drawn by ``rng``."""
    order = sorted(kept)
    rng.shuffle(order)
    return set(order[: max(1, len(order) // 10)])


def held_out_questions(
    seed: int = 0, count: int | None = None, exclude: str | Sequence[str] | None = None
) -> list[str]:
    """The questions ``distill`` with these options held out: a draft never trained on their answers."""
    asked = questions_of(seed, count)
    return [asked[i] for i in sorted(held_out(excluded(asked, exclude), random.Random(seed)))]


def questions_of(seed: int, count: int | None) -> dict[int, str]:
    """The first ``count`` questions of the set (all by default), by index."""
    return dict(enumerate(questions(seed)[:count]))


def save(draft: FeatureDraft, tokenizer: Any, out: Path, card: dict[str, Any]) -> None:
    """Write the whole draft (loadable as ``small=``) with its card, atomically."""
    save_folder(out, draft, tokenizer, card_files(card, "Feature-reading draft"))


if __name__ == "__main__":
    # Run the package's module, not this __main__ copy: the data file pickles Example by its module's name, and
    # only ead_llm.drafts.distill.Example can be found again by `ead-llm distill` or another process.
    from ead_llm.drafts.distill import main as _main

    _main()
