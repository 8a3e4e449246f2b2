"""``ead-llm bench``: accuracy against cost for every policy, with controls, intervals and plots.

    from ead_llm.evaluation.bench import bench
    report, files = bench(out="bench-results", quick=True)   # embedded pair and task

or piece by piece: :func:`embedded_task` / :func:`load_jsonl_task`, :class:`BenchConfig`,
:func:`run_bench` on an :class:`~ead_llm.core.engine.Engine`, :func:`render_table`, :func:`write_report`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.evaluation.bench.harness import (
    BenchConfig,
    BenchReport,
    BenchRun,
    EADVariant,
    Progress,
    choose_under_budget,
    planned_problems,
    run_bench,
)
from ead_llm.evaluation.bench.report import pareto_frontier, render_table, write_report
from ead_llm.evaluation.bench.tasks import (
    EXTRACTORS,
    SCORERS,
    BenchTask,
    Example,
    embedded_task,
    load_jsonl_task,
    normalize,
)

__all__ = [
    "EXTRACTORS",
    "SCORERS",
    "BenchConfig",
    "BenchReport",
    "BenchRun",
    "BenchTask",
    "EADVariant",
    "Example",
    "bench",
    "choose_under_budget",
    "embedded_task",
    "load_jsonl_task",
    "normalize",
    "pareto_frontier",
    "planned_problems",
    "render_table",
    "run_bench",
    "write_report",
]


def bench(
    small: str | None = None,
    large: str | None = None,
    *,
    task: BenchTask | None = None,
    config: BenchConfig | None = None,
    quick: bool = False,
    out: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    progress: Progress | None = None,
) -> tuple[BenchReport, dict[str, Path]]:
    """Load the pair (the embedded one by default), run the benchmark on ``task`` (the embedded task:
    100 dev and 200 test problems, or 20 and 30 with ``quick``), and write the files into ``out``
    (``partial.jsonl`` there gets each run's record as soon as it finishes)."""
    if (small is None) != (large is None):
        raise ValueError("pass both small= and large= (or neither, for the embedded pair)")
    if small is None or large is None:
        from ead_llm.embedded import embedded_pair

        small, large = embedded_pair()
    if task is None:
        task = embedded_task(20, 30) if quick else embedded_task()
    if config is None:
        config = BenchConfig.quick() if quick else BenchConfig()
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device=device, dtype=dtype)))
    partial = None
    if out is not None:  # each run as it finishes, so a long bench stopped early leaves what it measured
        Path(out).mkdir(parents=True, exist_ok=True)
        partial = Path(out) / "partial.jsonl"
        partial.write_text("")

    def on_run(run: BenchRun) -> None:
        if partial is not None:
            with partial.open("a") as handle:
                handle.write(json.dumps(run.record(), default=str) + "\n")

    try:
        report = run_bench(engine, task, config, progress=progress, on_run=on_run)
    finally:
        engine.close()
    files = write_report(report, out) if out is not None else {}
    return report, files
