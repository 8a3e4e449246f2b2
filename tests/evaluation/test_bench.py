"""The benchmark harness: tasks and extractors, the dev choice, matched controls, and its files."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.evaluation.bench import (
    BenchConfig,
    BenchTask,
    EADVariant,
    Example,
    choose_under_budget,
    embedded_task,
    load_jsonl_task,
    normalize,
    pareto_frontier,
    run_bench,
    write_report,
)
from ead_llm.evaluation.bench.harness import fixed_block_for, planned_problems
from ead_llm.evaluation.bench.report import goal_sentences
from ead_llm.evaluation.bench.tasks import EXTRACTORS, SCORERS, hash_split
from ead_llm.evaluation.evaluate import run_policy
from ead_llm.policies.controls import RandomSwitching
from ead_llm.policies.switching import EAD
from ead_llm.serving.cli import main


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("hashes", "12+3\n=15\n#### 15\n", "15"),
        ("hashes", "so #### 1,250 dollars\n#### 7", "1250"),
        ("hashes", "#### Paris\n", "Paris"),
        ("hashes", "no answer", None),
        ("last_number", "3 apples and 4.50 pears", "4.5"),
        ("first_line", "\n  yes  \nno", "yes"),
        ("boxed", r"thus \boxed{\frac{1}{2}} and \boxed{7}", "7"),
        ("boxed", r"\boxed{a{b}c}", "a{b}c"),
        ("boxed", r"\boxed{open", None),
        ("choice", "The answer is (C).", "C"),
        ("choice", "Answer: B", "B"),
        ("exact", "  0042 ", "42"),
    ],
)
def test_extractors(name: str, text: str, expected: str | None) -> None:
    task = BenchTask("t", (Example("p", "1"),), (Example("p", "1"),), name)
    assert task.extract(text) == expected


def test_normalize_and_score() -> None:
    assert normalize("1,000.0") == normalize("1000") == "1000"
    assert normalize("0.50") == "0.5" and normalize("-0") == "0" and normalize(" Paris ") == "Paris"
    task = BenchTask("t", (Example("p", "1"),), (Example("p", "1"),), "hashes")
    assert task.score("#### 1,000", "1000") and not task.score("#### 999", "1000") and not task.score("", "1")
    assert set(EXTRACTORS) == {"auto", "hashes", "last_number", "first_line", "boxed", "choice", "exact"}
    with pytest.raises(ValueError, match="extractor must be one of"):
        BenchTask("t", (), (), "regex")


def test_contains_scores_a_whole_word_or_phrase_anywhere() -> None:
    task = BenchTask("t", (Example("p", "Tokyo"),), (Example("p", "Tokyo"),), "contains")
    assert task.score("The capital of Japan is Tokyo.", "Tokyo")
    assert task.score("TOKYO, of course", "tokyo")
    assert task.score("It is New\n York City.", "New York")
    assert not task.score("Kyoto", "Tokyo") and not task.score("Romeo", "Rome") and not task.score("", "Rome")
    assert task.score("about 100 km", "100") and not task.score("1000 km", "100")
    assert not task.score("anything", "   ")
    # EAGER votes on the auto extraction, since ``contains`` needs the reference
    assert task.extract("The answer is Tokyo.") == "the answer is tokyo"
    assert "contains" in SCORERS


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_tasks_and_their_splits(tmp_path: Path) -> None:
    lines = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(200)]
    task = load_jsonl_task(_write(tmp_path / "t.jsonl", lines), extractor="last_number", dev_fraction=0.3)
    assert len(task.dev) + len(task.test) == 200 and 40 < len(task.dev) < 80
    assert all(hash_split(e.prompt, 0.3) == "dev" for e in task.dev)
    assert task.test[0].answer == str(int(task.test[0].prompt.split("+")[0]) + 1)
    marked = [{**r, "split": "dev" if i < 3 else "test"} for i, r in enumerate(lines[:10])]
    task = load_jsonl_task(_write(tmp_path / "m.jsonl", marked))
    assert [e.prompt for e in task.dev] == ["0+1=", "1+1=", "2+1="] and len(task.test) == 7
    task = load_jsonl_task(tmp_path / "m.jsonl", dev_path=_write(tmp_path / "d.jsonl", lines[:2]))
    assert len(task.dev) == 2 and len(task.test) == 7  # lines marked dev in the test file are left out
    assert task.limit(1, 5).dev == task.dev[:1] and len(task.limit(None, 5).test) == 5


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"prompt": "a", "answer": 1}\nnot json\n', r"bad\.jsonl:2: not JSON"),
        ('{"prompt": "", "answer": 1}\n', "'prompt' must be a non-empty string"),
        ('{"prompt": "a", "answer": [1]}\n', "'answer' must be a string or a number"),
        ('{"prompt": "a", "answer": 1, "split": "train"}\n', "'split' must be 'dev' or 'test'"),
        ("[1, 2]\n", "must be an object"),
        ("\n", "has no problems"),
        ('{"prompt": "a", "answer": 1, "split": "test"}\n', "needs problems in both splits"),
    ],
)
def test_jsonl_errors_say_what_to_change(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_jsonl_task(path)


def test_missing_task_file_and_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_jsonl_task(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="extractor"):
        load_jsonl_task(tmp_path / "nope.jsonl", extractor="nope")
    for bad, match in (
        ({"thresholds": ()}, "thresholds"),
        ({"thresholds": (-1.0,)}, "thresholds"),
        ({"budget": 1.5}, "budget"),
        ({"budget_metric": "usd"}, "budget_metric"),
        ({"batch_size": 0}, "batch_size"),
        ({"eager_paths": 0}, "eager_paths"),
        ({"prompt_format": "xml"}, "prompt_format"),
        ({"variants": ()}, "variants"),
        ({"dev_batch_size": 0}, "dev_batch_size"),
    ):
        with pytest.raises(ValueError, match=match):
            BenchConfig(**bad)  # type: ignore[arg-type]


def test_embedded_task_splits_are_disjoint() -> None:
    task = embedded_task(dev=30, test=40)
    assert len(task.dev) == 30 and len(task.test) == 40
    assert not {e.prompt for e in task.dev} & {e.prompt for e in task.test}
    assert task.score(f"#### {task.test[0].answer}\n", task.test[0].answer)


def test_choose_under_budget_by_hand() -> None:
    points = [(0.01, 0.90, 0.60), (0.05, 0.80, 0.25), (0.1, 0.80, 0.20), (0.2, 0.50, 0.10)]
    assert choose_under_budget(points, 0.25) == (0.1, True)  # tie on accuracy: the cheaper
    assert choose_under_budget(points, 1.0) == (0.01, True)
    assert choose_under_budget(points, 0.10) == (0.2, True)  # the budget is inclusive
    assert choose_under_budget(points, 0.05) == (0.2, False)  # none fits: the cheapest, flagged
    with pytest.raises(ValueError, match="at least one"):
        choose_under_budget([], 0.5)


def test_pareto_frontier_and_fixed_blocks_by_hand() -> None:
    points = [(1.0, 0.9), (0.3, 0.6), (0.5, 0.55), (0.3, 0.5), (0.0, 0.4), (0.6, 0.9), (0.8, 0.95)]
    assert pareto_frontier(points) == [(0.0, 0.4), (0.3, 0.6), (0.6, 0.9), (0.8, 0.95)]
    assert pareto_frontier([]) == []
    fixed = fixed_block_for(0.25, 10)
    assert (fixed.small_block, fixed.large_block) == (30, 10) and fixed.large_fraction == 0.25
    assert fixed_block_for(0.0, 10).large_fraction == 0.0 and fixed_block_for(1.0, 10).large_fraction == 1.0


def test_random_control_hits_a_matched_fraction_on_real_text() -> None:
    engine = EntropyAdaptiveLLM().shared_engine
    task = embedded_task(dev=1, test=40)
    target = run_policy(engine, task.test, EAD(threshold=0.05)).large_fraction
    control = run_policy(engine, task.test, RandomSwitching(fraction=target, block=10, seed=0))
    # ~600 blocks of 10 tokens: the realised fraction's standard deviation is about 0.02
    assert abs(control.large_fraction - target) < 0.06, (control.large_fraction, target)
    assert control.completions[0].roles != control.completions[1].roles[: len(control.completions[0].roles)]


def test_quick_bench_on_a_tiny_pair_writes_every_file(
    llama_paths: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [{"prompt": f"{i}+{i}=", "answer": 2 * i, "split": "dev" if i < 4 else "test"} for i in range(10)]
    task = _write(tmp_path / "sums.jsonl", lines)
    out = tmp_path / "out"
    small, large = map(str, llama_paths)
    argv = ["bench", "--quick", "--small", small, "--large", large, "--task", str(task), "--out", str(out)]
    argv += ["--extractor", "last_number", "--max-tokens", "12", "--thresholds", "3", "8", "--no-progress"]
    argv += ["--variants", "5:10", "1:1:lookahead", "--stop", "=="]
    assert main(argv) == 0
    shown = capsys.readouterr().out  # not a terminal: printed 100 columns wide
    table = [line for line in shown.splitlines() if not line.startswith("wrote ")]  # the files' paths are the test's
    assert max(len(line) for line in table) <= 100 and "\u2026" not in shown  # nothing cut short
    assert "EAD+lookahead w1/d1 tau=3" in shown and "(the embedded pair)" not in shown
    assert re.search(
        r"^goal: the large model writes [\d.]+% of its tokens \(goal <= 0.25\): (met|NOT met)\.$", shown, re.M
    )
    assert {p.name for p in out.iterdir()} == {
        "partial.jsonl",
        "results.json",
        "results.csv",
        "results.md",
        "accuracy_vs_large_fraction.png",
        "accuracy_vs_wall_clock.png",
        "accuracy_vs_flops.png",
    }
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    required = {"policy", "params", "split", "accuracy", "ci_low", "ci_high", "large_fraction", "parameter_ratio"}
    assert all(required | {"flops", "wall_time_s", "tokens_per_s"} <= set(r) for r in runs)
    test_policies = [r["policy"] for r in runs if r["split"] == "test"]
    for name in ("small_only", "large_only", "ead", "speculative", "easd", "eager", "random_switching", "oracle"):
        assert name in test_policies
    assert test_policies.count("ead") == 4 and test_policies.count("random_switching") == 4
    for name in ("speculative", "easd"):  # fixed and adaptive gamma
        assert sorted(r["params"]["adaptive_gamma"] for r in runs if r["policy"] == name) == [False, True]
    routers = [r for r in runs if r["policy"] == "query_router"]
    assert [(r["params"]["threshold"], r["params"]["probe"]) for r in routers] == [(3.0, 8), (8.0, 8)]
    assert "fixed_block" in test_policies
    assert sum(r["chosen"] for r in runs if r["split"] == "test" and r["policy"] == "ead") == 1
    assert [r["n"] for r in runs if r["split"] == "dev"] == [4] * 5 and all(
        r["n"] == 6 for r in runs if r["split"] == "test"
    )
    large = next(r for r in runs if r["split"] == "test" and r["policy"] == "large_only")
    assert large["speedup_vs_large"] == 1.0 and large["large_fraction"] == 1.0
    for run in runs:
        assert run["ci_low"] <= run["accuracy"] <= run["ci_high"] and run["flops"] > 0 and run["wall_time_s"] > 0
        if run["policy"] == "random_switching":
            assert run["vs_ead"] is not None and run["matched_to"].startswith("EAD")
            matched = next(r for r in runs if r["label"] == run["matched_to"] and r["split"] == "test")
            assert run["params"]["block"] == matched["params"]["min_dwell"]
            assert run["target_fraction"] == matched["large_fraction"]
    with (out / "results.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(runs)
    table = (out / "results.md").read_text().splitlines()  # the test split, a row per run in order
    tested = [r for r in runs if r["split"] == "test"]
    assert len(table) == 2 + len(tested) and table[1].count("---") == table[0].count("|") - 1
    for line, run in zip(table[2:], tested, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == run["label"] + (" *" if run["chosen"] else "") and cells[3] == f"{run['large_fraction']:.3f}"
    partial = [json.loads(line) for line in (out / "partial.jsonl").read_text().splitlines()]
    assert [(r["label"], r["split"]) for r in partial] == [(r["label"], r["split"]) for r in runs]  # as they ran
    assert all(len(r["outputs"]) == r["n"] and all("==" not in t for t in r["outputs"]) for r in runs)
    assert data["config"]["stop"] == ["=="] and len(data["machine"]["load_average"]) == 3
    assert (out / "accuracy_vs_large_fraction.png").read_bytes()[:4] == b"\x89PNG"


def test_regex_scorer_and_a_plain_progress_line_off_a_terminal(llama_paths, tmp_path: Path, capsys) -> None:
    task = BenchTask("t", (Example("a", "42"),), (Example("b", "7"),), "regex:answer is (\\d+)")
    assert task.score("so the answer is 42.", "42") and not task.score("42", "42")
    assert BenchTask("t", (), (), "regex:[0-9]+").extract("x 12 y 3") == "12"
    with pytest.raises(ValueError, match="not a regular expression"):
        BenchTask("t", (), (), "regex:(")
    lines = [{"prompt": f"{i}+{i}=", "answer": 2 * i, "split": "dev" if i < 2 else "test"} for i in range(4)]
    small, large = map(str, llama_paths)
    argv = ["bench", "--quick", "--small", small, "--large", large, "--task", str(_write(tmp_path / "t.jsonl", lines))]
    argv += ["--out", str(tmp_path / "out"), "--max-tokens", "4", "--thresholds", "3", "--variants", "5:10"]
    argv += ["--no-speculative", "--no-controls", "--eager-thetas", "--extractor", "regex:(\\d+)"]
    assert main(argv) == 0  # pytest's capture is not a terminal: plain lines, one per run
    err = capsys.readouterr().err
    assert "ead-llm bench: 0/" in err and "problems done, now LargeOnly" in err


def test_run_bench_python_api_and_progress(llama_paths: tuple[Path, Path], tmp_path: Path) -> None:
    small, large = map(str, llama_paths)
    engine = Engine(load_pair(LoadConfig(small=small, large=large)))
    task = BenchTask("sums", (Example("1+1=", "2"),) * 2, (Example("2+2=", "4"),) * 3, "last_number")
    config = BenchConfig(
        thresholds=(5.0,),
        variants=(EADVariant(2, 3),),
        eager_thetas=(),
        speculative=False,
        controls=False,
        max_tokens=6,
        batch_size=2,
    )
    seen: list[tuple[str, int]] = []
    report = run_bench(engine, task, config, progress=lambda label, n: seen.append((label, n)))
    assert sum(n for _, n in seen) == planned_problems(task, config) == 2 + 3 * 3
    assert [r.label for r in report.runs] == ["EAD w2/d3 tau=5", "SmallOnly", "LargeOnly", "EAD w2/d3 tau=5"]
    assert report.selection["threshold"] == 5.0
    files = write_report(report, tmp_path, plots=False)
    assert set(files) == {"json", "csv", "markdown"}
    assert report.goals()["large_fraction"]["value"] == report.runs[-1].cost.large_fraction
    with pytest.raises(ValueError, match="task must be a BenchTask"):
        run_bench(engine, "sums.jsonl", config)  # type: ignore[arg-type]
    engine.close()


def test_ead_variants_parse_and_validate() -> None:
    assert EADVariant.parse("5:10") == EADVariant(5, 10)
    assert EADVariant.parse("1:1:lookahead") == EADVariant(1, 1, lookahead=True)
    assert EADVariant(1, 1, lookahead=True).label(0.1) == "EAD+lookahead w1/d1 tau=0.1"
    assert EADVariant.parse("5:10:large") == EADVariant(5, 10, start_on="large")
    assert EADVariant.parse("1:1:lookahead:large") == EADVariant(1, 1, lookahead=True, start_on="large")
    assert EADVariant(5, 10, start_on="large").label(0.2) == "EAD w5/d10 start large tau=0.2"
    assert EADVariant(5, 10, start_on="large").policy(0.2).start().active == "large"
    for bad in ("5", "5:x", "1:1:look", "1:2:3:4", "1:1:large:large"):
        with pytest.raises(ValueError, match="EAD variant"):
            EADVariant.parse(bad)
    with pytest.raises(ValueError, match="window"):
        EADVariant(0, 1)
    with pytest.raises(ValueError, match="start_on"):
        EADVariant(5, 10, start_on="medium")


def test_timed_runs_repeat_take_the_median_and_warn_when_they_disagree(llama_paths, tmp_path: Path) -> None:
    from dataclasses import replace as swap

    small, large = map(str, llama_paths)
    engine = Engine(load_pair(LoadConfig(small=small, large=large)))
    task = BenchTask("sums", (Example("1+1=", "2"),), (Example("2+2=", "4"),) * 2, "last_number")
    config = BenchConfig(
        thresholds=(5.0,),
        variants=(EADVariant(2, 3),),
        eager_thetas=(),
        speculative=False,
        controls=False,
        max_tokens=6,
        repeats=3,
    )
    seen: list[int] = []
    report = run_bench(engine, task, config, progress=lambda label, n: seen.append(n))
    engine.close()
    assert sum(seen) == planned_problems(task, config) == 1 + 3 * 2 * 3
    for run in report.find("test"):
        assert len(run.wall_times) == 3 and run.cost.wall_time_s == sorted(run.wall_times)[1]
    assert all(r.wall_times == () for r in report.find("dev"))
    # the warning, on set timings (real ones are noise at this size): one repeat twice as slow as the others
    report.runs = [swap(r, wall_times=(1.0, 1.1, 1.0)) if r.wall_times else r for r in report.runs]
    slow = swap(report.runs[-1], wall_times=(1.0, 1.0, 2.0))
    report.runs[-1] = slow
    (warning,) = report.timing_warnings()
    assert warning.startswith(slow.label) and "100% apart" in warning
    assert report.to_json()["timing_warnings"] == [warning]


def test_plot_points_never_sit_on_each_other_and_crowded_axes_go_log() -> None:
    from ead_llm.evaluation.bench.plots import crowded, dodge

    points = [(0.5, 0.8), (0.5, 0.8), (0.5, 0.8), (0.9, 0.2)]
    xs = dodge(points)
    assert len(set(xs[:3])) == 3 and xs[3] == 0.9  # the three coincident points spread, the far one stays
    assert dodge([(0.1, 0.5), (0.6, 0.5)]) == [0.1, 0.6]
    assert crowded([0.0, 0.01, 0.02, 0.03, 0.05, 1.0])  # most points in the left fifth, over two decades
    assert not crowded([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    cluster = [(1.0, 0.99), (0.99, 0.99), (1.0, 0.995), (1.01, 0.99), (0.25, 0.5)]  # LargeOnly and its neighbours
    xs = dodge(cluster)
    step = 0.015 * (1.01 - 0.25)
    assert all(abs(a - b) >= step - 1e-12 for i, a in enumerate(xs[:4]) for b in xs[i + 1 : 4])
    assert abs(sum(xs[:4]) / 4 - 1.0) <= step and xs[4] == 0.25  # nudged both ways: the cluster stays in place


def test_log_axis_ticks_keep_zero_apart_from_the_first_decade() -> None:
    from ead_llm.evaluation.bench.plots import _from_symlog, _to_symlog, decade_ticks

    ticks = decade_ticks([0.0, 0.009, 0.05, 0.2, 1.0])
    assert ticks == [0.0, 1e-3, 1e-2, 1e-1, 1.0]
    linthresh = ticks[1] / 10
    assert _to_symlog(ticks[1], linthresh) - _to_symlog(0.0, linthresh) >= 1.0  # a decade apart, as drawn
    assert decade_ticks([0.02, 0.3]) == [1e-2, 1e-1, 1.0]  # no zero tick without a zero
    for x in (0.0, 5e-5, 1e-4, 0.03, 1.0):
        assert _from_symlog(_to_symlog(x, linthresh), linthresh) == pytest.approx(x)


def test_goals_read_as_sentences() -> None:
    goals = {
        "ead": "EAD w1/d1 tau=0.05",
        "accuracy_retained": {"value": 0.98, "goal": ">= 0.97", "met": True},
        "large_fraction": {"value": 0.3, "goal": "<= 0.25", "met": False},
        "wall_clock_vs_parameter_ratio": {
            "value": 3.0,
            "wall_cost_vs_large": 0.6,
            "parameter_ratio": 0.2,
            "ideal_wall_cost_vs_large": 0.45,
            "small_only_wall_cost_vs_large": None,
            "goal": "<= 1.2",
            "met": False,
        },
        "beats_random": {
            "ead_accuracy": 0.99,
            "random_accuracy": 0.48,
            "random_ci_high": 0.55,
            "random_large_fraction": 0.175,
            "mcnemar_p": 5e-30,
            "met": True,
        },
    }
    assert goal_sentences(goals) == [
        "goal: EAD w1/d1 tau=0.05 keeps 98.0% of LargeOnly's accuracy (goal >= 0.97): met.",
        "goal: the large model writes 30.0% of its tokens (goal <= 0.25): NOT met.",
        "goal: its wall clock is 0.60 of LargeOnly's, 3.00x its parameter ratio 0.200 (ideal from each model's speed "
        "0.45; goal <= 1.2x): NOT met.",
        "goal: its accuracy 99.0% is above the random control's 95% interval (random switching at the same large "
        "fraction, 0.175: 48.0%, at most 55.0%; McNemar p = 5e-30): met.",
    ]
    assert goal_sentences({}) == []
