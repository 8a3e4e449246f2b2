"""Writing a benchmark's results: a terminal table, ``results.json``, ``results.csv``, ``results.md`` and PNG
plots."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ead_llm.evaluation.bench.harness import BenchReport

CSV_COLUMNS = (
    "label",
    "policy",
    "kind",
    "split",
    "n",
    "correct",
    "accuracy",
    "ci_low",
    "ci_high",
    "large_fraction",
    "parameter_ratio",
    "flops",
    "wall_time_s",
    "tokens_per_s",
    "completion_tokens",
    "small_processed_tokens",
    "large_processed_tokens",
    "switches",
    "speedup_vs_large",
    "wall_cost_vs_large",
    "flops_vs_large",
    "accuracy_vs_large",
    "ideal_wall_cost_vs_large",
    "wall_vs_ideal",
    "chosen",
    "matched_to",
    "target_fraction",
    "mcnemar_p_vs_ead",
    "params",
)


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats (cost no higher and accuracy no lower, one strictly), by cost."""
    frontier: list[tuple[float, float]] = []
    for cost, accuracy in sorted(points, key=lambda p: (p[0], -p[1])):
        if not frontier or accuracy > frontier[-1][1]:
            frontier.append((cost, accuracy))
    return frontier


def pair_name(pair: dict[str, Any]) -> str:
    """``small + large`` by their short names: the embedded pair, or each folder's or file's last part, or its
    Hub id."""
    from ead_llm.embedded import EMBEDDED_DIR

    if all(Path(pair[role]).parent == EMBEDDED_DIR for role in ("small", "large")):
        return "the embedded pair"

    def short(source: str) -> str:
        path = Path(source)
        return path.name if path.exists() or source.startswith(("/", "~", ".")) else source

    return " + ".join(short(pair[role]) for role in ("small", "large"))


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(report: BenchReport, console: Console | None = None) -> None:
    """Print the test split's runs in two tables of at most 100 columns (accuracy and cost, then speed), the dev
    selection, and the goals as sentences."""
    console = console or Console()
    records = [r for r in report.records() if r["split"] == "test"]
    labels = [r["label"] + (" *" if r["chosen"] else "") for r in records]
    title = f"{report.task}, test split: accuracy and cost ({pair_name(report.pair)})"
    quality = Table(title=title, title_justify="left")
    speed = Table(title="the same runs: time, against LargeOnly (L) and the ideal", title_justify="left")
    for table, columns in (
        (quality, ("run", "accuracy", "95% CI", "p vs EAD", "large frac", "param ratio")),
        (speed, ("run", "wall s", "tok/s", "wall vs L", "vs ideal", "FLOPs vs L")),
    ):
        for column in columns:
            table.add_column(column, justify="left" if column == "run" else "right", no_wrap=column != "run")
    for label, record in zip(labels, records, strict=True):
        vs_ead = record["vs_ead"]
        quality.add_row(
            label,
            f"{record['accuracy']:.1%}",
            f"{record['ci_low']:.1%}-{record['ci_high']:.1%}",
            "-" if vs_ead is None else f"{vs_ead['p_value']:.2g}",
            f"{record['large_fraction']:.3f}",
            f"{record['parameter_ratio']:.3f}",
        )
        speed.add_row(
            label,
            f"{record['wall_time_s']:.1f}",
            f"{record['tokens_per_s']:.0f}",
            _fmt(record["wall_cost_vs_large"], ".2f"),
            _fmt(record["wall_vs_ideal"], ".2f"),
            _fmt(record["flops_vs_large"], ".2f"),
        )
    console.print(quality)
    console.print(speed)
    selection = report.selection
    console.print(
        f"* chosen on dev ({len(report.find('dev', 'ead')[0].correct)} problems): {selection['ead']}, "
        f"best dev accuracy with {selection['metric']} <= {selection['budget']:g}"
        + ("" if selection["within_budget"] else " (no threshold met the budget: the cheapest was taken)")
        + (f"; EAGER theta={selection['eager_theta']:g}" if "eager_theta" in selection else "")
    )
    for sentence in goal_sentences(report.goals()):
        console.print(sentence)


def goal_sentences(goals: dict[str, Any]) -> list[str]:
    """Each goal of :meth:`BenchReport.goals` as one sentence that gives its numbers and ends met or not met."""

    def verdict(goal: dict[str, Any]) -> str:
        return "met" if goal["met"] else "NOT met"

    out = []
    ead = goals.get("ead", "EAD")
    if (goal := goals.get("accuracy_retained")) is not None:
        kept = "unknown" if goal["value"] is None else f"{goal['value']:.1%}"
        out.append(f"goal: {ead} keeps {kept} of LargeOnly's accuracy (goal {goal['goal']}): {verdict(goal)}.")
    if (goal := goals.get("large_fraction")) is not None:
        out.append(
            f"goal: the large model writes {goal['value']:.1%} of its tokens (goal {goal['goal']}): {verdict(goal)}."
        )
    if (goal := goals.get("wall_clock_vs_parameter_ratio")) is not None and goal["value"] is not None:
        extra = [f"ideal from each model's speed {goal['ideal_wall_cost_vs_large']:.2f}"]
        if goal["small_only_wall_cost_vs_large"] is not None:
            extra.append(f"SmallOnly {goal['small_only_wall_cost_vs_large']:.2f}")
        out.append(
            f"goal: its wall clock is {goal['wall_cost_vs_large']:.2f} of LargeOnly's, {goal['value']:.2f}x its "
            f"parameter ratio {goal['parameter_ratio']:.3f} ({'; '.join(extra)}; goal {goal['goal']}x): "
            f"{verdict(goal)}."
        )
    if (goal := goals.get("beats_random")) is not None:
        out.append(
            f"goal: its accuracy {goal['ead_accuracy']:.1%} is above the random control's 95% interval (random "
            f"switching at the same large fraction, {goal['random_large_fraction']:.3f}: "
            f"{goal['random_accuracy']:.1%}, at most {goal['random_ci_high']:.1%}; McNemar p = "
            f"{goal['mcnemar_p']:.2g}): {verdict(goal)}."
        )
    return out


def _csv_row(record: dict[str, Any]) -> dict[str, Any]:
    row = {key: record.get(key) for key in CSV_COLUMNS}
    row["mcnemar_p_vs_ead"] = record["vs_ead"]["p_value"] if record["vs_ead"] else None
    row["params"] = json.dumps(record["params"], sort_keys=True, default=str)
    return row


MARKDOWN_COLUMNS = (
    ("run", lambda r: r["label"] + (" *" if r["chosen"] else "")),
    ("accuracy", lambda r: f"{r['accuracy']:.1%}"),
    ("95% CI", lambda r: f"[{r['ci_low']:.1%}, {r['ci_high']:.1%}]"),
    ("large frac", lambda r: f"{r['large_fraction']:.3f}"),
    ("wall s", lambda r: f"{r['wall_time_s']:.1f}"),
    ("wall vs L", lambda r: _fmt(r["wall_cost_vs_large"], ".2f")),
    ("vs ideal", lambda r: _fmt(r["wall_vs_ideal"], ".2f")),
    ("p vs EAD", lambda r: "-" if r["vs_ead"] is None else f"{r['vs_ead']['p_value']:.2g}"),
)
"""The markdown table's columns and how each cell is written from a run of ``results.json``."""


def markdown_table(data: dict[str, Any], split: str = "test") -> str:
    """One split's runs of ``results.json``'s ``data`` as a markdown table (``*``: the threshold chosen on dev)."""
    runs = [r for r in data["runs"] if r["split"] == split]
    lines = ["| " + " | ".join(name for name, _ in MARKDOWN_COLUMNS) + " |", "|" + " --- |" * len(MARKDOWN_COLUMNS)]
    lines += ["| " + " | ".join(cell(r).replace("|", "\\|") for _, cell in MARKDOWN_COLUMNS) + " |" for r in runs]
    return "\n".join(lines) + "\n"


def write_report(report: BenchReport, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write ``results.json``, ``results.csv``, ``results.md`` (the test split's table) and (with ``plots``) the
    PNG plots into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    files = {"json": out / "results.json", "csv": out / "results.csv", "markdown": out / "results.md"}
    files["json"].write_text(json.dumps(data, indent=1, default=str) + "\n")
    files["markdown"].write_text(markdown_table(data))
    with files["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(CSV_COLUMNS))
        writer.writeheader()
        for record in data["runs"]:
            writer.writerow(_csv_row(record))
    if plots:
        from ead_llm.evaluation.bench.plots import plot_all

        files.update(plot_all(data, out))
    return files
