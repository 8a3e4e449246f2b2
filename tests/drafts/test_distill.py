"""``ead-llm distill`` on a tiny target: two steps write a draft that loads as ``small=`` beside its target and
decodes losslessly, the same seed gives the same weights, a benchmark's questions can be left out, and bad
options are refused before any model loads."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from ead_llm import LargeOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.drafts import distill
from ead_llm.drafts.model import OWN_FILE, assemble, load_own, save_own, target_features
from ead_llm.serving.cli import build_parser
from ead_llm.testing.tiny import TinyShape, build_tiny_pair, byte_bpe_tokenizer
from tests.tiny_pairs import BPE_CORPUS, CHAT_TEMPLATE


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("distill-target")
    tokenizer = byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)
    tokenizer.chat_template = CHAT_TEMPLATE
    _, large = build_tiny_pair(root, tokenizer=tokenizer, large=TinyShape(hidden=64, layers=2, heads=4, mlp=128))
    return large


def _args(target: Path, out: Path, *extra: str) -> list[str]:
    small = ["--questions", "12", "--samples", "2", "--max-tokens", "8", "--vocab", "200", "--batch", "4"]
    return ["--large", str(target), "--out", str(out), "--steps", "2", "--threads", "1", *small, *extra]


TRAINED = ("--seed", "3", "--depth", "2", "--bfloat16", "--mlp-width", "2")
"""The fixture's draft: training-time test over 2 passes, under bfloat16 autocast, its MLP twice the target's."""


@pytest.fixture(scope="module")
def trained(target: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("distilled") / "draft"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distill, "bfloat16_native", lambda: True)  # bfloat16 as asked, whatever this CPU has
        card = distill.main(_args(target, out, *TRAINED))
    return out, card


def test_two_steps_write_a_draft_with_its_card(target: Path, trained: tuple[Path, dict]) -> None:
    out, card = trained
    assert card["steps"] == 2 and card["budget"] == "2 steps" and card["seed"] == 3
    assert card["held_out_questions"] == 1 and card["held_out_answers"] == 2  # 10% of 12 questions, 2 answers each
    assert 0.0 <= card["top1_agreement_before"] <= 1.0 and 0.0 <= card["top1_agreement_after"] <= 1.0
    assert 0.0 <= card["top1_agreement_after_greedy_answers"] <= 1.0
    assert card["top1_agreement_by_round_token"][0] == card["top1_agreement_after"]
    assert len(card["top1_agreement_by_round_token_greedy_answers"]) == distill.REPORTED_STEPS
    assert "2 passes of training-time test" in card["objective"] and card["precision"] == "bfloat16 autocast"
    assert card["design"].startswith("1 decoder layer(s) with 2 times the target's MLP units")
    assert 0.0 < card["head_coverage"] <= 1.0
    assert (out / "draft_card.json").is_file() and "top1_agreement_after" in (out / "README.md").read_text()
    from transformers import AutoModelForCausalLM

    distill.register()
    draft = AutoModelForCausalLM.from_pretrained(out)
    large = AutoModelForCausalLM.from_pretrained(target)
    assert draft.vocab_index.numel() == 200
    # trained: the layer moved away from the target's last layer it started as; the embeddings stayed the target's
    moved = draft.layers[0].mlp.down_proj.weight
    assert moved.shape == (64, 2 * 128) and draft.config.intermediate_size == 2 * 128
    assert not torch.equal(moved[:, :128], large.model.layers[-1].mlp.down_proj.weight)
    assert moved[:, 128:].any()  # the added units, started at zero, learned
    assert torch.equal(draft.embed_tokens.weight, large.model.embed_tokens.weight)
    assert torch.equal(draft.head.weight, large.lm_head.weight[draft.vocab_index])


def test_the_distilled_draft_decodes_losslessly_beside_its_target(target: Path, trained: tuple[Path, dict]) -> None:
    engine = Engine(load_pair(LoadConfig(small=str(trained[0]), large=str(target), device="cpu")))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12)
        prompts = ["the cat sat", "a dog ran to"]
        large = engine.generate([Request(p, LargeOnly(), params) for p in prompts])
        spec = engine.generate([Request(p, SpeculativeDecoding(gamma=3), params) for p in prompts])
        assert [r.text for r in spec] == [r.text for r in large]
        assert sum(r.cost.extra["drafted_tokens"] for r in spec) > 0
    finally:
        engine.close()


def test_the_same_seed_gives_the_same_draft_and_its_own_weights_round_trip(
    target: Path, trained: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(distill, "bfloat16_native", lambda: True)  # as the fixture's draft was trained
    again = distill.main(_args(target, tmp_path / "again", *TRAINED))
    first = load_file(str(trained[0] / "model.safetensors"))
    second = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert again["top1_agreement_after"] == trained[1]["top1_agreement_after"]
    # what a project ships: its own weights in float16, reassembled with the target's embeddings
    from transformers import AutoModelForCausalLM

    distill.register()
    draft = AutoModelForCausalLM.from_pretrained(trained[0])
    save_own(draft, tmp_path / "own")
    assert (tmp_path / "own" / OWN_FILE).stat().st_size < (trained[0] / "model.safetensors").stat().st_size
    config, own = load_own(tmp_path / "own")
    rebuilt = assemble(AutoModelForCausalLM.from_pretrained(target), config, own)
    ids = torch.tensor([[5, 17, 40, 41, 99]])
    features = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = draft(ids, features=features).logits, rebuilt(ids, features=features).logits
    assert torch.equal(want.isinf(), got.isinf())
    assert torch.allclose(want[~want.isinf()], got[~got.isinf()], atol=5e-3)  # float16 rounding of own weights


def test_excluded_questions_are_left_out(tmp_path: Path) -> None:
    asked = distill.questions_of(0, 30)
    listed = tmp_path / "bench.jsonl"
    listed.write_text(f'{{"prompt": "{asked[4]}", "answer": "x"}}\n\n{asked[7]}\n')
    assert distill.excluded(asked, str(listed)) == set(range(30)) - {4, 7}
    assert distill.excluded(asked, None) == set(range(30))
    other = tmp_path / "own.jsonl"
    other.write_text(f"{asked[9]}\n")
    assert distill.excluded(asked, [str(listed), str(other)]) == set(range(30)) - {4, 7, 9}
    assert distill.questions_of(0, 30) == asked and distill.questions_of(1, 30) != asked  # seeded order


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--vocab", "-3"], "--vocab must be at least 1"),
        (["--layers", "0"], "--layers must be at least 1"),
        (["--mlp-width", "0"], "--mlp-width must be at least 1"),
        (["--depth", "0"], "--depth must be at least 1"),
        (["--unroll-from", "1"], "--unroll-from is a share of training in [0, 1)"),
        (["--minutes", "0"], "--minutes and --lr must be positive"),
        (["--own-questions", "-1"], "--own-questions must be at least 0"),
        (["--own-samples", "0"], "--own-samples at least 1"),
        (["--lr", "nan"], "--minutes and --lr must be positive"),
    ],
)
def test_bad_options_are_refused_before_loading(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        distill.main(["--large", "no/such-model", "--out", str(tmp_path / "x"), *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("option", "message"), [("--layers", "1 to 2 layers"), ("--mlp-width", "1 to 2 times")])
def test_a_draft_larger_than_its_target_is_refused_before_any_data(
    target: Path, option: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny target has 2 layers: a draft of 3 (or 3 times its MLP) is refused before a question is answered."""
    data = tmp_path / "data.pt"
    with pytest.raises(SystemExit) as exit_info:
        distill.main(_args(target, tmp_path / "x", option, "3", "--data", str(data)))
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not data.exists() and not (tmp_path / "x").exists()


def test_a_missing_target_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        distill.main(["--large", str(tmp_path / "missing"), "--out", str(tmp_path / "x"), "--steps", "1"])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["cli", "module"])
@pytest.mark.parametrize("preset", [None, "0"])
def test_distill_asks_for_huge_pages_unless_the_caller_chose(
    entry: str, preset: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both entry points turn on torch's huge pages for the training process (fewer page faults under the batch's
    large tensors), and leave a caller's own setting as it is."""
    from ead_llm.drafts import HUGE_PAGES
    from ead_llm.serving.cli import main as cli_main

    if preset is None:
        monkeypatch.delenv(HUGE_PAGES, raising=False)
    else:
        monkeypatch.setenv(HUGE_PAGES, preset)
    argv = ["--large", str(tmp_path), "--out", str(tmp_path / "x"), "--steps", "0"]
    if entry == "cli":  # refused after the setting, before any model loads
        assert cli_main(["distill", *argv]) == 2
    else:
        with pytest.raises(SystemExit):
            distill.main(argv)
    assert os.environ[HUGE_PAGES] == (preset or "1")


def test_the_cli_runs_the_subcommand(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ead_llm.serving.cli import main

    assert main(["distill", *_args(target, tmp_path / "cli")]) == 0
    assert "top-1 agreement" in capsys.readouterr().out and (tmp_path / "cli" / "draft_card.json").is_file()


def test_the_cli_has_the_subcommand() -> None:
    argv = ["distill", "--large", "m", "--out", "o", "--steps", "2", "--exclude", "b.jsonl", "c.jsonl"]
    args = build_parser().parse_args(argv)
    assert args.steps == 2 and args.exclude == ["b.jsonl", "c.jsonl"] and args.func.__name__ == "cmd_distill"


@torch.inference_mode()
def test_the_engines_features_and_best_tokens_are_transformers(target: Path) -> None:
    """The features come from the engine's own passes as it writes the answers (no second forward): they are the
    final hidden states transformers computes over each whole text, and each answer's best tokens its head's
    argmax on them, greedy answers and sampled ones alike."""
    from transformers import AutoModelForCausalLM

    prompts = dict(enumerate(distill.questions(0)[:3]))
    examples = distill.written(str(target), prompts, [(q, k) for q in range(3) for k in range(2)], 0, 10, None)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    assert len({tuple(e.ids) for e in examples}) == 6  # the sampled answers are not the greedy ones
    for example in examples:
        truth = target_features(model, torch.tensor([example.ids]))[0]
        assert example.features.shape == truth.shape and not example.features[-1].any()  # the last is never read
        assert torch.allclose(example.features[:-1], truth[:-1], atol=1e-4)
        best = model.lm_head(truth[example.start : -1]).argmax(-1)
        assert torch.equal(example.best, best)


def test_a_second_run_adds_only_the_missing_answers(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More samples or questions than the data file holds: only those are written, and the file then holds the
    answers a single run would have written."""
    data = tmp_path / "data.pt"
    distill.main(_args(target, tmp_path / "a", "--data", str(data), "--samples", "1", "--questions", "8"))
    asked: list[list[tuple[int, int]]] = []
    write = distill.written

    def counted(source: str, prompts: list[str], wanted: list[tuple[int, int]], *rest: object) -> list:
        asked.append(list(wanted))
        return write(source, prompts, wanted, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(distill, "written", counted)
    grown = distill.main(_args(target, tmp_path / "b", "--data", str(data)))  # 12 questions, 2 samples
    assert asked == [[(q, k) for q in range(12) for k in range(2) if q >= 8 or k == 1]]
    distill.main(_args(target, tmp_path / "c", "--data", str(tmp_path / "single.pt")))
    assert grown["held_out_answers"] == 2
    by_key = {(e.question, e.sample): e.ids for e in torch.load(data, weights_only=False)}
    assert by_key == {(e.question, e.sample): e.ids for e in torch.load(tmp_path / "single.pt", weights_only=False)}


def test_a_data_file_written_otherwise_is_refused(target: Path, tmp_path: Path) -> None:
    """Answers written with another seed or length are not this run's: a run that would reuse them is refused
    before it trains, and the file is left as it was."""
    data = tmp_path / "data.pt"
    distill.main(_args(target, tmp_path / "a", "--data", str(data), "--questions", "8", "--samples", "1"))
    before = data.read_bytes()
    for other in ({"max_tokens": 6}, {"seed": 1, "max_tokens": 8}):
        with pytest.raises(ValueError, match=r"answers were written as .* use another --data file"):
            distill.distill(str(target), tmp_path / "b", steps=1, questions=8, samples=1, data=str(data), **other)
    assert data.read_bytes() == before and not (tmp_path / "b").exists()


def test_a_data_file_written_by_python_m_is_read_by_the_package(target: Path, tmp_path: Path) -> None:
    """``python -m ead_llm.drafts.distill`` keeps its data under the package's class names, so ``ead-llm distill``
    (or any other process) can reuse the file."""
    import subprocess
    import sys

    data = tmp_path / "data.pt"
    argv = [sys.executable, "-m", "ead_llm.drafts.distill", *_args(target, tmp_path / "a", "--data", str(data))]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    examples = torch.load(data, weights_only=False)
    assert examples and all(type(e) is distill.Example for e in examples)


def test_ship_draft_writes_what_fast_draft_assembles(
    target: Path, trained: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    from ead_llm.testing import smollm2

    monkeypatch.setattr(smollm2, "SHIPPED_DRAFT", tmp_path / "shipped")
    shipped = smollm2.ship_draft(trained[0], "ead-llm distill --steps 2")
    assert sorted(p.name for p in shipped.iterdir()) == ["README.md", "config.json", "draft_card.json", OWN_FILE]
    card = json.loads((shipped / "draft_card.json").read_text())
    assert card["command"] == "ead-llm distill --steps 2" and card["steps"] == trained[1]["steps"]
    distill.register()
    config, own = load_own(shipped)
    rebuilt = assemble(AutoModelForCausalLM.from_pretrained(target), config, own)
    original = AutoModelForCausalLM.from_pretrained(trained[0])
    for name, weight in original.state_dict().items():  # the own weights went through float16
        assert torch.allclose(rebuilt.state_dict()[name].float(), weight.float(), atol=1e-3), name


def test_training_time_test_takes_over_at_its_share_of_training(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[int] = []
    loss_of = distill.loss_of

    def recorded(*args: object) -> torch.Tensor:
        used.append(int(args[-1]))  # type: ignore[call-overload]
        return loss_of(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(distill, "loss_of", recorded)
    args = _args(target, tmp_path / "d", "--depth", "3", "--unroll-from", "0.5")
    distill.main([*args[: args.index("--steps")], "--steps", "4", *args[args.index("--steps") + 2 :]])
    assert used == [1, 1, 3, 3]


def test_the_loss_weighs_the_feature_pull_and_the_best_token_as_asked(target: Path) -> None:
    """``loss_of``'s terms add as weighted: the feature pull and the best token's cross-entropy each scale with
    their weight, and the best token is the target's argmax among the head's tokens."""
    from transformers import AutoModelForCausalLM

    from ead_llm.drafts.model import new_draft
    from ead_llm.drafts.unroll import unrolled

    model = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(0)
    draft = new_draft(model, torch.arange(0, 200, 2), mlp_width=2).float().eval()
    hidden = model.config.hidden_size
    group = [
        distill.Example(question=q, ids=list(range(3, 3 + n)), start=2, features=torch.randn(n, hidden))
        for q, n in ((0, 9), (1, 6))
    ]

    @torch.no_grad()
    def loss(feature: float, best: float) -> float:
        return float(distill.loss_of(draft, group, [False, True], 0.0, None, feature_weight=feature, top1_weight=best))

    bare, pull, top = loss(0, 0), loss(1, 0) - loss(0, 0), loss(0, 1) - loss(0, 0)
    assert pull > 0 and top > 0
    assert loss(2, 0) - bare == pytest.approx(2 * pull, rel=1e-5)
    assert loss(0, 3) - bare == pytest.approx(3 * top, rel=1e-5)
    with torch.no_grad():
        assert loss(1, 0) == pytest.approx(float(distill.loss_of(draft, group, [False, True], 0.0, None)))  # default
        ids, feats = distill.inputs_of(group, [False, True], 0.0, None)
        index, _ = distill._answer_index(group)
        truth = torch.stack([group[r].features[c] for r, c in zip(*index, strict=True)])
        logits = draft.head(unrolled(draft, ids, feats, 1)[0][index])
    assert top == pytest.approx(float(F.cross_entropy(logits, draft.head(truth).argmax(-1))), rel=1e-4)


def test_agreement_counts_each_token_of_a_round_where_the_whole_sequence_would(target: Path) -> None:
    """``agreement`` (which computes each answer's positions alone) counts the draft's best tokens against the
    target's as the passes over whole sequences give them, from ``j`` positions into each answer for the
    ``j``-th token of a round."""
    from transformers import AutoModelForCausalLM

    from ead_llm.drafts.model import new_draft
    from ead_llm.drafts.unroll import unrolled

    model = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(0)
    draft = new_draft(model, torch.arange(0, 200, 2), mlp_width=2).float().eval()
    hidden = model.config.hidden_size
    examples = [
        distill.Example(question=q, ids=[3 + (7 * i) % 90 for i in range(n)], start=s, features=torch.randn(n, hidden))
        for q, n, s in ((0, 9, 2), (1, 6, 3), (2, 11, 1))
    ]
    with torch.no_grad():
        ids, feats = distill.inputs_of(examples, [True] * 3, 0.0, None)
        whole = [draft.vocab_index[draft.head(out).argmax(-1)] for out in unrolled(draft, ids, feats, 3)]
    for example, row in zip(examples, whole[0], strict=True):  # the target agrees with pass 0 on every other token
        mine = row[example.start : len(example.ids) - 1].clone()
        mine[1::2] = (mine[1::2] + 2) % 200
        example.best = mine
    expected = []
    for j in range(3):
        same = total = 0
        for r, example in enumerate(examples):
            mine = whole[j][r, example.start + j : len(example.ids) - 1]
            same += int((mine == example.best[j:]).sum())
            total += mine.numel()
        expected.append(same / total)
    assert distill.agreement(draft, examples, depth=3) == pytest.approx(expected)
    assert 0.4 < expected[0] < 0.7  # every other token, so a slice one off would not agree as often


def test_own_questions_are_seeded_by_their_index(target: Path) -> None:
    from transformers import AutoTokenizer

    assert distill.user_turn(AutoTokenizer.from_pretrained(target)) == "<|user|>"  # the template up to the words
    together = distill.own_questions(str(target), [0, 1, 2, 3], seed=5, dtype=None)
    alone = distill.own_questions(str(target), [2], seed=5, dtype=None)
    assert alone == {2: together[2]} and set(together) == {0, 1, 2, 3}
    assert distill.own_questions(str(target), [2], seed=6, dtype=None) != alone or alone[2] == ""


def test_own_questions_join_the_set_without_moving_its_held_out_questions(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Own questions (a fake writer here) are asked after the set's: blank and repeated ones are not asked, each
    is answered --own-samples times, a tenth is held out apart from the set's tenth (which stays what it was),
    and a data file keeps them, so a second run writes only the ones it lacks."""
    asked_for: list[list[int]] = []

    def fake(source: str, indices: list[int], seed: int, dtype: str | None) -> dict[int, str]:
        asked_for.append(list(indices))
        return {i: "" if i == 3 else ("same question" if i in (5, 6) else f"own question {i}") for i in indices}

    monkeypatch.setattr(distill, "own_questions", fake)
    seen: list[list[distill.Example]] = []
    real_gathered = distill.gathered

    def spy(*args: object, **kwargs: object) -> list[distill.Example]:
        out = real_gathered(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(out)
        return out

    monkeypatch.setattr(distill, "gathered", spy)
    drawn: list[set[int]] = []
    real_held_out = distill.held_out

    def held_spy(kept: set[int], rng: random.Random) -> set[int]:
        out = real_held_out(kept, rng)
        drawn.append(set(out))
        return out

    monkeypatch.setattr(distill, "held_out", held_spy)
    data = str(tmp_path / "data.pt")
    own = ("--own-questions", "20", "--own-samples", "2", "--data", data)
    card = distill.main(_args(target, tmp_path / "a", "--questions", "12", *own))
    assert asked_for == [list(range(20))]
    examples = seen[-1]
    owned = [e for e in examples if e.question >= distill.OWN_FIRST]
    questions = {e.question - distill.OWN_FIRST for e in owned}
    assert questions == set(range(20)) - {3, 6}  # blank, and a repeat of 5
    assert all(sum(e.question == q for e in owned) == 2 for q in {e.question for e in owned})
    assert card["held_out_questions"] == 1 + 1  # a tenth of 12 set questions, a tenth of 18 own ones
    assert "and 34 answers (2 each: the first greedy) to 17 questions it wrote itself" in card["data"], card["data"]
    assert len(card["top1_agreement_by_round_token_own_questions"]) == distill.REPORTED_STEPS
    set_held, own_held = drawn[-2:]
    assert set_held < set(range(12)) and len(own_held) == 1 and min(own_held) >= distill.OWN_FIRST
    plain = distill.main(_args(target, tmp_path / "b", "--questions", "12"))
    assert plain["held_out_questions"] == 1 and "own" not in plain["data"]
    assert drawn[-2:] == [set_held, set()]  # the set's held-out question is the one drawn without own questions
    again = distill.main(_args(target, tmp_path / "c", "--questions", "12", *own[:1], "24", *own[2:]))
    assert asked_for[1:] == [list(range(20, 24))]  # the data file kept the first 20
    assert again["held_out_questions"] == 1 + 2
    with pytest.raises(ValueError, match="use another --data file"):  # its answers belong to other questions
        distill.distill(str(target), tmp_path / "d", steps=1, questions=12, own_questions=24, data=data, seed=1)


def test_bfloat16_is_declined_where_the_cpu_has_no_bfloat16_arithmetic(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without bfloat16 in hardware (torch emulates it, several times slower than float32), ``--bfloat16`` and
    ``--data-dtype bfloat16`` run in float32, saying so in the log and the card; the data file's folder is made."""
    autocasts: list[bool] = []
    autocast = torch.autocast

    def recorded(*args: object, **kwargs: object) -> torch.autocast:
        autocasts.append(bool(kwargs.get("enabled", True)))
        return autocast(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(distill.torch, "autocast", recorded)
    monkeypatch.setattr(distill, "bfloat16_native", lambda: False)
    lines: list[str] = []
    data = tmp_path / "not" / "yet" / "data.pt"
    card = distill.distill(
        str(target),
        tmp_path / "a",
        steps=2,
        threads=1,
        questions=12,
        samples=2,
        max_tokens=8,
        vocab=200,
        batch=4,
        bfloat16=True,
        data=str(data),
        data_dtype="bfloat16",
        log=lines.append,
    )
    assert card["precision"] == "float32" and card["data_dtype"].startswith("training answers written in float32")
    assert "no bfloat16 arithmetic" in card["bfloat16_declined"] and card["bfloat16_declined"] in lines
    assert autocasts == [False, False]
    assert all("dtype" not in e.written_as for e in torch.load(data, weights_only=False))
    assert distill.in_hardware(bfloat16=True, data_dtype="bfloat16", native=True) == (True, "bfloat16", "")
    assert distill.in_hardware(bfloat16=False, data_dtype="float32", native=False) == (False, "float32", "")
    assert distill.in_hardware(bfloat16=False, data_dtype="bfloat16", native=False)[:2] == (False, "float32")


def test_training_answers_can_be_written_in_bfloat16_and_held_out_ones_stay_float32(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--data-dtype bfloat16``: the target writes the training answers in bfloat16 and the held-out answers that
    score the draft in float32, and the data file says which is which; a float32 run on the same file writes again
    the training answers only, and a bfloat16 run after it again those."""
    calls: list[tuple[list[tuple[int, int]], str | None]] = []
    write = distill.written

    def counted(source: str, prompts: list[str], wanted: list[tuple[int, int]], *rest: object) -> list:
        calls.append((list(wanted), rest[-1]))  # type: ignore[arg-type]
        return write(source, prompts, wanted, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(distill, "written", counted)
    monkeypatch.setattr(distill, "bfloat16_native", lambda: True)  # bfloat16 as asked, whatever this CPU has
    data = tmp_path / "data.pt"
    card = distill.main(_args(target, tmp_path / "a", "--data", str(data), "--data-dtype", "bfloat16"))
    assert card["data_dtype"] == "training answers written in bfloat16, held-out ones in float32"
    examples = torch.load(data, weights_only=False)
    held = {e.question for e in examples if "dtype" not in e.written_as}
    assert len(held) == card["held_out_questions"] == 1  # a tenth of 12
    assert all(e.written_as["dtype"] == "bfloat16" for e in examples if e.question not in held)
    everything = sorted((q, k) for q in range(12) for k in range(2))
    assert sorted(calls[0][0] + calls[1][0]) == everything and {c[1] for c in calls} == {None, "bfloat16"}
    assert next(c[0] for c in calls if c[1] is None) == [(q, k) for q in sorted(held) for k in range(2)]
    del calls[:]
    distill.main(_args(target, tmp_path / "b", "--data", str(data)))  # float32: the training answers again
    assert calls == [([(q, k) for q, k in everything if q not in held], None)]
    assert all("dtype" not in e.written_as for e in torch.load(data, weights_only=False))
    del calls[:]
    distill.main(_args(target, tmp_path / "c", "--data", str(data), "--data-dtype", "bfloat16"))
    assert calls == [([(q, k) for q, k in everything if q not in held], "bfloat16")]
    distill.main(_args(target, tmp_path / "e", "--data", str(data), "--questions", "8"))  # float32, fewer questions
    kept = torch.load(data, weights_only=False)
    assert sorted((e.question, e.sample) for e in kept) == everything  # those it did not ask for are kept
    assert all(e.written_as.get("dtype") == "bfloat16" for e in kept if e.question >= 8 and e.question not in held)
    with pytest.raises(SystemExit):
        distill.main(_args(target, tmp_path / "d", "--data-dtype", "float16"))
