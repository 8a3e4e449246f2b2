"""Writing a benchmark's results: a terminal table, ``results.json``, ``results.csv`` and PNG plots."""

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


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(report: BenchReport, console: Console | None = None) -> None:
    """Print the test split's runs, then the dev selection and the goals."""
    console = console or Console()
    table = Table(title=f"{report.task}: test split ({report.pair['small']} + {report.pair['large']})")
    columns = ["run", "accuracy", "95% CI", "large frac", "param ratio", "wall s", "tok/s", "wall vs L", "vs ideal"]
    for column in (*columns, "FLOPs vs L", "p vs EAD"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
    for record in report.records():
        if record["split"] != "test":
            continue
        label = record["label"] + (" *" if record["chosen"] else "")
        vs_ead = record["vs_ead"]
        table.add_row(
            label,
            f"{record['accuracy']:.1%}",
            f"[{record['ci_low']:.1%}, {record['ci_high']:.1%}]",
            f"{record['large_fraction']:.3f}",
            f"{record['parameter_ratio']:.3f}",
            f"{record['wall_time_s']:.1f}",
            f"{record['tokens_per_s']:.0f}",
            _fmt(record["wall_cost_vs_large"], ".2f"),
            _fmt(record["wall_vs_ideal"], ".2f"),
            _fmt(record["flops_vs_large"], ".2f"),
            "-" if vs_ead is None else f"{vs_ead['p_value']:.2g}",
        )
    console.print(table)
    selection = report.selection
    console.print(
        f"* chosen on dev ({len(report.find('dev', 'ead')[0].correct)} problems): {selection['ead']}, "
        f"best dev accuracy with {selection['metric']} <= {selection['budget']:g}"
        + ("" if selection["within_budget"] else " (no threshold met the budget: the cheapest was taken)")
        + (f"; EAGER theta={selection['eager_theta']:g}" if "eager_theta" in selection else "")
    )
    for name, goal in report.goals().items():
        if isinstance(goal, dict):
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in goal.items()}
            console.print(f"goal {name}: {shown}")


def _csv_row(record: dict[str, Any]) -> dict[str, Any]:
    row = {key: record.get(key) for key in CSV_COLUMNS}
    row["mcnemar_p_vs_ead"] = record["vs_ead"]["p_value"] if record["vs_ead"] else None
    row["params"] = json.dumps(record["params"], sort_keys=True, default=str)
    return row


def write_report(report: BenchReport, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write ``results.json``, ``results.csv`` and (with ``plots``) the PNG plots into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    files = {"json": out / "results.json", "csv": out / "results.csv"}
    files["json"].write_text(json.dumps(data, indent=1, default=str) + "\n")
    with files["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(CSV_COLUMNS))
        writer.writeheader()
        for record in data["runs"]:
            writer.writerow(_csv_row(record))
    if plots:
        from ead_llm.evaluation.bench.plots import plot_all

        files.update(plot_all(data, out))
    return files
