"""PNG plots of a benchmark's test split (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from ead_llm.evaluation.bench.report import pareto_frontier

STYLE: dict[str, dict[str, Any]] = {
    "small_only": {"marker": "o", "color": "tab:gray", "label": "SmallOnly"},
    "large_only": {"marker": "o", "color": "black", "label": "LargeOnly"},
    "random_switching": {"marker": "x", "color": "tab:red", "label": "random switching (matched fraction)"},
    "fixed_block": {"marker": "s", "color": "tab:orange", "label": "fixed-block switching"},
    "oracle": {"marker": "D", "color": "tab:green", "label": "oracle (top-1 disagreements)"},
    "speculative": {"marker": "^", "color": "tab:purple", "label": "speculative decoding"},
    "easd": {"marker": "v", "color": "tab:pink", "label": "EASD"},
    "eager": {"marker": "P", "color": "tab:brown", "label": "EAGER"},
}
SWITCHING = ("small_only", "large_only", "ead", "random_switching", "fixed_block", "oracle")


def _errors(runs: list[dict[str, Any]]) -> list[list[float]]:
    return [[r["accuracy"] - r["ci_low"] for r in runs], [r["ci_high"] - r["accuracy"] for r in runs]]


EAD_COLORS = ("tab:blue", "tab:cyan", "navy", "tab:olive")


def _series(run: dict[str, Any]) -> str:
    """Which line a run belongs to: its policy, and for EAD its variant (the label without tau)."""
    return run["label"].rsplit(" tau=", 1)[0] if run["policy"] == "ead" else run["policy"]


def _style(series: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    if series in STYLE:
        return STYLE[series]
    variants = sorted({_series(r) for r in runs if r["policy"] == "ead"})
    color = EAD_COLORS[variants.index(series) % len(EAD_COLORS)]
    return {"marker": "o", "color": color, "label": f"{series} (threshold sweep)"}


def dodge(points: list[tuple[float, float]], size: float = 0.012) -> list[float]:
    """x positions for ``points`` such that none sits on an earlier one: a point within ``size`` of the
    axes' spans (in x and in y) of earlier points moves right by ``size`` of the x span per such point."""
    if not points:
        return []
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_span = (max(xs) - min(xs)) or 1.0
    y_span = (max(ys) - min(ys)) or 1.0
    out: list[float] = []
    for i, (x, y) in enumerate(points):
        near = sum(
            1 for j in range(i) if abs(points[j][0] - x) <= size * x_span and abs(points[j][1] - y) <= size * y_span
        )
        out.append(x + near * size * x_span)
    return out


def crowded(xs: list[float]) -> bool:
    """Whether most points (60%) sit in the left fifth of the x range while the range spans a decade or
    more: a log axis then spreads them."""
    positive = [x for x in xs if x > 0]
    if len(positive) < 3 or max(positive) <= 0:
        return False
    low, high = min(xs), max(xs)
    left = sum(1 for x in xs if x <= low + 0.2 * (high - low))
    return left >= 0.6 * len(xs) and max(positive) / min(positive) >= 10


def _draw(ax: Axes, runs: list[dict[str, Any]], x_key: str, policies: tuple[str, ...] | None = None) -> None:
    shown = [r for r in runs if r.get(x_key) is not None and (policies is None or r["policy"] in policies)]
    if crowded([r[x_key] for r in shown]):
        ax.set_xscale("symlog", linthresh=max(1e-3, min(r[x_key] for r in shown if r[x_key] > 0)))
    shifted = dodge([(r[x_key], r["accuracy"]) for r in shown])
    x_of = {id(r): x for r, x in zip(shown, shifted, strict=True)}
    for series in dict.fromkeys(_series(r) for r in shown):
        style = _style(series, shown)
        group = [r for r in shown if _series(r) == series]
        line = len(group) > 1 and group[0]["policy"] == "ead"
        if line:  # a sweep is drawn in threshold order (times are noisy: sorting by x would zig-zag)
            group.sort(key=lambda r: r["params"]["threshold"])
        ax.errorbar(
            [x_of[id(r)] for r in group],
            [r["accuracy"] for r in group],
            yerr=_errors(group),
            fmt=style["marker"] + ("-" if line else ""),
            color=style["color"],
            label=style["label"],
            capsize=3,
            markersize=6,
            markerfacecolor="none",  # hollow: a marker drawn over another leaves it visible
            linewidth=1,
        )
        for run in group:
            if run["chosen"]:
                ax.plot(x_of[id(run)], run["accuracy"], "*", color=style["color"], markersize=16)
    by_label = {r["label"]: r for r in shown}
    for run in shown:  # a thin line from each control to the EAD point it is matched to
        matched = by_label.get(run["matched_to"]) if run.get("matched_to") else None
        if matched is not None:
            xs, ys = [x_of[id(run)], x_of.get(id(matched), matched[x_key])], [run["accuracy"], matched["accuracy"]]
            ax.plot(xs, ys, ":", color=STYLE[run["policy"]]["color"], linewidth=0.8, alpha=0.6)
    frontier = pareto_frontier([(r[x_key], r["accuracy"]) for r in shown])
    if frontier:
        xs = [p[0] for p in frontier]
        ys = [p[1] for p in frontier]
        ax.step(xs, ys, where="post", linestyle="--", color="lightgray", zorder=0, label="Pareto frontier")
    ax.set_ylabel("test accuracy (95% Wilson interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)


def _large_reference(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in runs if r["policy"] == "large_only"), None)


def plot_all(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """Accuracy against large-token fraction, wall-clock cost and FLOPs (test split); the paths written."""
    runs = [r for r in data["runs"] if r["split"] == "test"]
    title = f"{data['task']}: {Path(data['pair']['small']).name} + {Path(data['pair']['large']).name}"
    large = _large_reference(runs)
    files: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(11, 5.5))
    _draw(ax, runs, "large_fraction", SWITCHING)
    if large is not None:
        ax.axhline(0.97 * large["accuracy"], color="black", linestyle=":", linewidth=1, label="97% of LargeOnly")
    ax.axvline(data["config"]["budget"], color="tab:blue", linestyle=":", linewidth=1, label="dev budget")
    ax.set_xlabel("fraction of tokens from the large model")
    ax.set_title(f"{title}\naccuracy against large-model tokens (* = chosen on dev)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    files["plot_large_fraction"] = out / "accuracy_vs_large_fraction.png"
    fig.tight_layout()
    fig.savefig(files["plot_large_fraction"], dpi=110)
    plt.close(fig)

    for key, name, xlabel in (
        ("wall_cost_vs_large", "accuracy_vs_wall_clock.png", "wall-clock time relative to LargeOnly"),
        ("flops_vs_large", "accuracy_vs_flops.png", "forward FLOPs relative to LargeOnly"),
    ):
        fig, ax = plt.subplots(figsize=(11, 5.5))
        _draw(ax, runs, key)
        if key == "wall_cost_vs_large":
            ead = [r for r in runs if r["policy"] == "ead" and r[key] is not None]
            for run in ead:  # where the parameter ratio says EAD should be
                ax.plot([run["parameter_ratio"], run[key]], [run["accuracy"]] * 2, color="tab:gray", alpha=0.3)
            ax.plot(
                [r["parameter_ratio"] for r in ead],
                [r["accuracy"] for r in ead],
                "o",
                markerfacecolor="none",
                color="tab:gray",
                label="EAD points at their parameter ratio",
            )
        ax.set_xlabel(xlabel)
        ax.set_title(f"{title}\n{xlabel.split(' relative')[0]}: accuracy against cost")
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        files[f"plot_{key.split('_')[0]}"] = out / name
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    return files
